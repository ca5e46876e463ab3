"""Compile for a GPU this machine does not have.

XLA:GPU compiles without a device when it is given a description of the
target (a ``GpuTargetConfigProto`` in text format) through the CUDA PJRT
plugin. ``gpu_target("h100")`` builds that topology once; ``target.abstract``
turns arguments into ``jax.ShapeDtypeStruct`` s placed on the target's device,
so that ``jaxstreams.jit(f).lower(*target.abstract(x, w)).compile()`` runs
XLA:GPU's whole pipeline and ``.as_text()`` is the scheduled HLO that GPU
would run.

Needs, at exactly jaxlib's version, the CUDA plugin (no driver, no GPU)::

    # V = jaxlib.__version__
    pip install "jax-cuda13-plugin==$V" "jax-cuda13-pjrt==$V"

and ``ptxas`` / ``libdevice`` from a CUDA toolkit (``/usr/local/cuda``) or the
``nvidia-cuda-nvcc`` wheel. Set ``JAX_PLATFORMS=cpu`` on a machine without a
GPU, before jax starts a backend.

Sharp edge: ``lower(lowering_platforms=("cuda",))`` compiles for XLA:CPU;
only arguments placed on the topology's device compile for the GPU.
Without a device XLA does not autotune: GEMM configurations are defaults, so
fusions and the schedule can differ from a real GPU's compile.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import os
import pathlib
import shutil
from typing import Any

import jax
import jaxlib

# Published figures (NVIDIA H100 / H200 SXM datasheets and the Hopper tuning
# guide): 132 SMs at compute capability 9.0, 228 KiB shared memory per SM (227
# KiB opt-in per block), 64 Ki registers per SM, 50 MiB L2, boost clock 1.98
# GHz. H100 SXM: 80 GB HBM3 at 3.35 TB/s. H200 SXM: 141 GB HBM3e at 4.8 TB/s.
# Only fields that jax 0.10.2, 0.11.2 and 0.12.0.1 all parse.
_HOPPER_SXM = """\
gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {bandwidth}
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: {memory}
  shared_memory_per_block_optin: 232448
  cuda_compute_capability {{
    major: 9
    minor: 0
  }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
  driver_version: "13.0.0"
  runtime_version: "13.0.0"
}}
platform_name: "CUDA"
dnn_version_info {{
  major: 9
  minor: 8
}}
device_description_str: "{description}"
"""

BUILTIN_TARGETS = {
    "h100": _HOPPER_SXM.format(bandwidth=3_352_000_000_000,
                               memory=80 * 10**9,
                               description="NVIDIA H100 80GB HBM3"),
    "h200": _HOPPER_SXM.format(bandwidth=4_800_000_000_000,
                               memory=141 * 10**9,
                               description="NVIDIA H200"),
}

PLUGIN_PACKAGES = ("jax-cuda13-plugin", "jax-cuda13-pjrt")


class GpuTargetError(RuntimeError):
  """What is missing to compile for a GPU without one, and how to install it."""


def install_command() -> str:
  """The pip command that installs the CUDA plugin at the running jaxlib's
  version."""
  version = jaxlib.__version__
  return "pip install " + " ".join(f'"{p}=={version}"' for p in PLUGIN_PACKAGES)


def _check_plugin() -> None:
  wanted = jaxlib.__version__
  for package in PLUGIN_PACKAGES:
    try:
      found = importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
      raise GpuTargetError(
          "compiling for a GPU target needs the CUDA PJRT plugin; "
          f"{package} is not installed. Install it at jaxlib's version: "
          f"{install_command()}"
      ) from None
    if found != wanted:
      raise GpuTargetError(
          f"{package} {found} does not match jaxlib {wanted}; XLA refuses a "
          f"plugin of another version. Install the matching one: "
          f"{install_command()}")


def _check_ptxas() -> None:
  if shutil.which("ptxas"):
    return
  for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"),
               "/usr/local/cuda"):
    if root and (pathlib.Path(root) / "bin" / "ptxas").exists():
      return
  try:
    importlib.metadata.version("nvidia-cuda-nvcc")
    return
  except importlib.metadata.PackageNotFoundError:
    pass
  try:  # the CUDA 13 wheels name it without the suffix
    importlib.metadata.version("nvidia-cuda-nvcc-cu13")
    return
  except importlib.metadata.PackageNotFoundError:
    pass
  raise GpuTargetError(
      "XLA:GPU needs ptxas and libdevice to compile: install a CUDA toolkit "
      "(ptxas on PATH, or CUDA_HOME pointing at it) or "
      "`pip install nvidia-cuda-nvcc`.")


@dataclasses.dataclass(frozen=True)
class GpuTarget:
  """A GPU node to compile for: its name, its target description, and its
  devices (``mesh``: all of them on one axis, ``"x"``)."""
  name: str
  config_text: str
  topology: Any = dataclasses.field(repr=False)
  mesh: jax.sharding.Mesh = dataclasses.field(repr=False)

  @property
  def sharding(self) -> jax.sharding.NamedSharding:
    """The whole value on every device of the target (one for one GPU)."""
    return jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())

  def make_mesh(self, axis_shapes, axis_names) -> jax.sharding.Mesh:
    """A mesh of the target's devices, as ``jax.make_mesh`` makes one of
    real devices: for shardings and ``shard_map`` of a program compiled for
    a node of several GPUs."""
    from jax.experimental import topologies
    return topologies.make_mesh(self.topology, tuple(axis_shapes),
                                tuple(axis_names))

  def abstract(self, *args):
    """``args`` (arrays, ShapeDtypeStructs or pytrees of them) as
    ShapeDtypeStructs on the target's device: what ``lower`` needs to compile
    for this GPU, as a tuple: ``f.lower(*target.abstract(x, w))``."""
    def to_struct(leaf):
      if not hasattr(leaf, "shape") or not hasattr(leaf, "dtype"):
        raise TypeError(
            f"GpuTarget.abstract takes arrays or ShapeDtypeStructs (or pytrees "
            f"of them); got {type(leaf).__name__}: {leaf!r}")
      return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype,
                                  sharding=self.sharding)
    return tuple(jax.tree_util.tree_map(to_struct, args))


def gpu_target(name: str, devices: int = 1) -> GpuTarget:
  """A node of ``devices`` GPUs ``name`` ("h100", "h200", or a path to a
  GpuTargetConfigProto text file) as a compile target. Raises
  GpuTargetError naming what to install when the CUDA plugin or ptxas is
  missing."""
  if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
    raise ValueError(f"gpu_target: devices must be a positive int, got "
                     f"{devices!r}")
  return target_from_config(*target_config(name), devices=devices)


def target_config(name: str) -> tuple[str, str]:
  """``(name, GpuTargetConfigProto text)`` of a built-in target or a file,
  without making a topology (which needs the CUDA plugin in this process)."""
  key = str(name).lower()
  if key in BUILTIN_TARGETS:
    return key, BUILTIN_TARGETS[key]
  path = pathlib.Path(name)
  if path.is_file():
    return path.name, path.read_text()
  raise ValueError(
      f"unknown GPU target {name!r}: give one of {sorted(BUILTIN_TARGETS)} "
      "or the path of a GpuTargetConfigProto text file")


@functools.lru_cache(maxsize=None)
def target_from_config(name: str, config_text: str,
                       devices: int = 1) -> GpuTarget:
  """A node of ``devices`` GPUs described by ``config_text`` (a
  GpuTargetConfigProto in text format), called ``name``; made once per
  process."""
  _check_plugin()
  _check_ptxas()
  from jax.experimental import topologies
  try:
    topology = topologies.get_topology_desc(
        platform="cuda", target_config=config_text,
        topology=f"1x1x{devices}")   # slices x hosts x devices per host
  except Exception as error:  # XLA reports parse errors as XlaRuntimeError
    hint = ""
    if os.environ.get("JAX_PLATFORMS", "") != "cpu" and "cuda" not in {
        d.platform for d in jax.devices()}:
      hint = (" On a machine without a GPU, set JAX_PLATFORMS=cpu before jax "
              "starts (the CUDA plugin otherwise fails to start and leaves no "
              "CUDA compiler).")
    raise GpuTargetError(
        f"XLA could not make a CUDA topology for target {name!r}: "
        f"{error}.{hint}") from error
  mesh = topologies.make_mesh(topology, (devices,), ("x",))
  made = GpuTarget(name, config_text, topology, mesh)
  _MADE.append(made)
  return made


_MADE: list[GpuTarget] = []   # every target made in this process


def placed_on(device) -> GpuTarget | None:
  """The target made in this process whose devices include ``device`` (an
  argument placed by ``GpuTarget.abstract``), None for any other device."""
  for made in _MADE:
    if any(d is device for d in made.mesh.devices.flat):
      return made
  return None
