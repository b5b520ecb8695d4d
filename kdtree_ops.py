"""kdtree_ops: fast tree-verify ops for MLA models, as PyTorch custom ops.

Every op is declared once here under ``torch.ops.kdtree``, with a pure-torch CPU reference
(the semantic truth), a fake impl (for ``torch.compile`` and meta tracing) and a CUDA impl
compiled from ``kdtree_ops_src/`` on first import on a machine with a CUDA GPU.

Environment variables
---------------------
KDTREE_CACHE_DIR   where built libraries live (default ``~/.cache/kdtree_ops``).
KDTREE_CUDA_ARCH   compute capabilities to build for, e.g. ``9.0`` or ``9.0;12.0``
                   (default: the current GPU's).
KDTREE_NO_BUILD=1  never build or load the CUDA kernels; the CPU references still work.
KDTREE_CHECK=1     validate index ranges and mask shapes on the device before each launch
                   (syncs the host; not for CUDA-graph capture).
KDTREE_VERBOSE=1   show the compiler's output while building.
"""

from __future__ import annotations

if __name__ == "__main__":  # `python -m kdtree_ops`: run the real module once, not a copy
    import sys

    import kdtree_ops

    sys.exit(kdtree_ops.main())

import fcntl
import hashlib
import math
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import NamedTuple, Optional, Sequence

import torch


SRC_DIR = Path(__file__).resolve().with_name("kdtree_ops_src")
_lib = torch.library.Library("kdtree", "DEF")  # every schema is defined through this


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def check_mode() -> bool:
    """True when KDTREE_CHECK asks for device-side validation of indices and masks."""
    return _env_flag("KDTREE_CHECK")


# --------------------------------------------------------------------------------------------
# JIT build: one ninja file, one object per source (so they compile in parallel), one .so
# per (sources, flags, torch, CUDA, arch) hash. A flock serialises concurrent builders; the
# kernel releases it when a builder dies, so a killed build never blocks later imports.
# --------------------------------------------------------------------------------------------

_NVCC_FLAGS = [
    "-O3",
    "-std=c++20",
    "--expt-relaxed-constexpr",
    "-lineinfo",
    "-Xcompiler=-fPIC",
    "-DNDEBUG",
]


def _cuda_home() -> Path:
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(str(Path(nvcc).resolve().parent.parent))
        # nvcc may be a wrapper script: the toolkit is wherever it execs.
        try:
            text = Path(nvcc).read_text(errors="ignore")[:4096]
            for word in text.split():
                if word.endswith("/bin/nvcc"):
                    candidates.append(str(Path(word).parent.parent))
        except OSError:
            pass
    candidates.append("/usr/local/cuda")
    for c in candidates:
        if c and (Path(c) / "bin" / "nvcc").exists() and (Path(c) / "include" / "cuda_runtime.h").exists():
            return Path(c)
    raise RuntimeError(
        "kdtree_ops: a CUDA GPU is present but no CUDA toolkit was found to build the kernels. "
        "Install the CUDA toolkit (nvcc, matching torch.version.cuda="
        f"{torch.version.cuda}) and set CUDA_HOME to its folder, or set KDTREE_NO_BUILD=1 "
        "to use the CPU reference ops only."
    )


def _ninja() -> str:
    exe = shutil.which("ninja")
    if exe is None:
        try:
            import ninja  # type: ignore

            exe = str(Path(ninja.BIN_DIR) / "ninja")
        except ImportError:
            exe = None
    if exe is None or not Path(exe).exists():
        raise RuntimeError(
            "kdtree_ops: building the CUDA kernels needs ninja: `pip install ninja`, "
            "or set KDTREE_NO_BUILD=1 to use the CPU reference ops only."
        )
    return exe


def _arch_list(arch: Optional[Sequence[str]] = None) -> list[str]:
    if arch:
        archs = list(arch)
    elif os.environ.get("KDTREE_CUDA_ARCH"):
        archs = os.environ["KDTREE_CUDA_ARCH"].replace(",", ";").split(";")
    else:
        major, minor = torch.cuda.get_device_capability()
        archs = [f"{major}.{minor}"]
    out = []
    for a in archs:
        a = a.strip().lower().removeprefix("sm_")
        if not a:
            continue
        if "." not in a:
            a = f"{a[:-1]}.{a[-1]}"
        major = int(a.split(".")[0])
        if major < 8:
            raise RuntimeError(f"kdtree_ops: needs compute capability 8.0 or newer, got sm_{a}")
        out.append(a)
    return sorted(set(out))


def _gencode(archs: list[str]) -> list[str]:
    flags = []
    for a in archs:
        num = a.replace(".", "")
        flags.append(f"-gencode=arch=compute_{num},code=sm_{num}")
    return flags


def _sources() -> list[Path]:
    return sorted(p for p in SRC_DIR.iterdir() if p.suffix in (".cu", ".cuh"))


def _build_key(archs: list[str]) -> str:
    h = hashlib.sha256()
    for p in _sources():
        h.update(p.name.encode())
        h.update(p.read_bytes())
    for part in (_NVCC_FLAGS, archs, [torch.__version__, str(torch.version.cuda)]):
        h.update(repr(part).encode())
    return h.hexdigest()[:16]


def cache_root() -> Path:
    return Path(os.environ.get("KDTREE_CACHE_DIR") or Path.home() / ".cache" / "kdtree_ops")


def _write_ninja(build_dir: Path, cuda_home: Path, archs: list[str], lib_name: str) -> None:
    from torch.utils import cpp_extension

    includes = [SRC_DIR, *map(Path, cpp_extension.include_paths("cuda")), cuda_home / "include"]
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    cflags = _NVCC_FLAGS + _gencode(archs) + [f"-D_GLIBCXX_USE_CXX11_ABI={abi}"]
    cflags += ["-Xptxas=-v"] if _env_flag("KDTREE_PTXAS_VERBOSE") else []
    cflags += [f"-I{p}" for p in includes]
    torch_lib = Path(torch.__file__).parent / "lib"
    ldflags = [
        "-shared",
        "-cudart=shared",
        f"-L{torch_lib}",
        f"-Xlinker=-rpath,{torch_lib}",
        "-lc10",
        "-lc10_cuda",
        "-ltorch_cpu",
        "-ltorch_cuda",
    ]
    nvcc = cuda_home / "bin" / "nvcc"
    cu = [p for p in _sources() if p.suffix == ".cu"]
    headers = " ".join(str(p) for p in _sources() if p.suffix == ".cuh")
    lines = [
        "ninja_required_version = 1.3",
        f"nvcc = {nvcc}",
        f"cflags = {' '.join(cflags)}",
        f"ldflags = {' '.join(ldflags)}",
        "rule cu",
        "  command = $nvcc $cflags -c $in -o $out",
        "  description = nvcc $in",
        "rule link",
        "  command = $nvcc $in $ldflags -o $out",
        "  description = link $out",
    ]
    objs = []
    for p in cu:
        obj = f"{p.stem}.o"
        objs.append(obj)
        lines.append(f"build {obj}: cu {p} | {headers}")
    lines.append(f"build {lib_name}: link {' '.join(objs)}")
    lines.append(f"default {lib_name}")
    (build_dir / "build.ninja").write_text("\n".join(lines) + "\n")


def build(arch: Optional[Sequence[str]] = None, verbose: Optional[bool] = None) -> Path:
    """Compile ``kdtree_ops_src/`` (or find it already built) and return the library path.

    Parameters
    ----------
    arch : list of str, optional
        Compute capabilities such as ``["9.0", "12.0"]``. Default: ``KDTREE_CUDA_ARCH``, else
        the current GPU's. Works without a GPU when given, so sources can be checked anywhere.
    verbose : bool, optional
        Stream the compiler's output (default: ``KDTREE_VERBOSE``).
    """
    archs = _arch_list(arch)
    key = _build_key(archs)
    build_dir = cache_root() / f"{key}-sm_{'_'.join(a.replace('.', '') for a in archs)}"
    lib_name = "kdtree_ops_cuda.so"
    lib_path = build_dir / lib_name
    done = build_dir / "BUILT"
    if done.exists() and lib_path.exists():
        return lib_path  # built before: load without running ninja
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # other builders wait here, then find BUILT
        if done.exists() and lib_path.exists():
            return lib_path
        cuda_home = _cuda_home()
        ninja = _ninja()
        archs_txt = ", ".join(f"sm_{a.replace('.', '')}" for a in archs)
        print(
            f"kdtree_ops: building CUDA kernels for {archs_txt} (first use, about a minute) "
            f"in {build_dir}",
            file=sys.stderr,
            flush=True,
        )
        _write_ninja(build_dir, cuda_home, archs, lib_name)
        jobs = os.environ.get("MAX_JOBS") or str(os.cpu_count() or 4)
        verbose = _env_flag("KDTREE_VERBOSE") if verbose is None else verbose
        proc = subprocess.run(
            [ninja, "-j", jobs, "-v"] if verbose else [ninja, "-j", jobs],
            cwd=build_dir,
            stdout=None if verbose else subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"kdtree_ops: building the CUDA kernels failed:\n{proc.stdout or ''}")
        done.write_text(key + "\n")
    return lib_path


_CUDA_LOADED = False


def _load_cuda() -> None:
    global _CUDA_LOADED
    if _env_flag("KDTREE_NO_BUILD") or not torch.cuda.is_available():
        return
    torch.ops.load_library(str(build()))
    _CUDA_LOADED = True


def cuda_available() -> bool:
    """True when the CUDA kernels are built and registered in this process."""
    return _CUDA_LOADED


def _define(schema: str):
    """Declare an op from its schema and register `fn` as its CPU reference impl."""
    name = schema.split("(", 1)[0]
    _lib.define(schema)

    def register(fn):
        _lib.impl(name, fn, "CPU")
        return fn

    return register


# --------------------------------------------------------------------------------------------
# merge_state: LSE merge of two partial attention results
# --------------------------------------------------------------------------------------------


def _merge_state_math(v_a, s_a, v_b, s_b):
    acc = torch.promote_types(v_a.dtype, torch.float32)
    m = torch.maximum(s_a, s_b)
    finite = m > -math.inf
    m0 = torch.where(finite, m, torch.zeros_like(m))
    w_a = torch.where(finite, torch.exp(s_a - m0), torch.zeros_like(m))
    w_b = torch.where(finite, torch.exp(s_b - m0), torch.zeros_like(m))
    total = w_a + w_b
    inv = torch.where(total > 0, 1.0 / total, torch.zeros_like(total))
    v = (v_a.to(acc) * (w_a * inv)[..., None] + v_b.to(acc) * (w_b * inv)[..., None]).to(v_a.dtype)
    s = torch.where(total > 0, m0 + torch.log(total), torch.full_like(m, -math.inf))
    return v, s.to(s_a.dtype)


def _check_merge_args(v_a, s_a, v_b, s_b):
    for name, v, s in (("a", v_a, s_a), ("b", v_b, s_b)):
        torch._check(v.dim() == 3, lambda: f"kdtree: v_{name} must be [T, H, D], got {tuple(v.shape)}")
        torch._check(v.shape == v_a.shape, lambda: f"kdtree: v_{name} must have shape {tuple(v_a.shape)}, got {tuple(v.shape)}")
        torch._check(v.dtype == v_a.dtype, lambda: f"kdtree: v_{name} must be {v_a.dtype} like v_a, got {v.dtype}")
        torch._check(
            s.dtype == torch.float32 or s.dtype == v_a.dtype == torch.float64,
            lambda: f"kdtree: s_{name} must be float32, got {s.dtype}",
        )
        torch._check(s.shape == v_a.shape[:2], lambda: f"kdtree: s_{name} must have shape {tuple(v_a.shape[:2])}, got {tuple(s.shape)}")


@_define("merge_state(Tensor v_a, Tensor s_a, Tensor v_b, Tensor s_b) -> (Tensor, Tensor)")
def _merge_state_cpu(v_a, s_a, v_b, s_b):
    _check_merge_args(v_a, s_a, v_b, s_b)
    return _merge_state_math(v_a, s_a, v_b, s_b)


@torch.library.register_fake("kdtree::merge_state")
def _merge_state_fake(v_a, s_a, v_b, s_b):
    _check_merge_args(v_a, s_a, v_b, s_b)
    return torch.empty_like(v_a, memory_format=torch.contiguous_format), torch.empty_like(
        s_a, memory_format=torch.contiguous_format
    )


@_define("merge_state_(Tensor(a!) v_a, Tensor(b!) s_a, Tensor v_b, Tensor s_b) -> ()")
def _merge_state_inplace_cpu(v_a, s_a, v_b, s_b):
    _check_merge_args(v_a, s_a, v_b, s_b)
    v, s = _merge_state_math(v_a, s_a, v_b, s_b)
    v_a.copy_(v)
    s_a.copy_(s)


@torch.library.register_fake("kdtree::merge_state_")
def _merge_state_inplace_fake(v_a, s_a, v_b, s_b):
    return None


def merge_state(
    v_a: torch.Tensor, s_a: torch.Tensor, v_b: torch.Tensor, s_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partial attention results over disjoint key sets by log-sum-exp.

    Parameters
    ----------
    v_a, v_b : Tensor [T, H, D], float32 / bfloat16 / float16 (same dtype)
        Each partial's attention output, normalised over its own keys.
    s_a, s_b : Tensor [T, H], float32
        Each partial's log-sum-exp of scores (natural log); ``-inf`` marks an empty partial.

    Returns
    -------
    v : Tensor [T, H, D], dtype of ``v_a``
        Attention output over the union of both key sets (zeros where both are empty).
    s : Tensor [T, H], float32
        Its log-sum-exp (``-inf`` where both are empty).
    """
    return torch.ops.kdtree.merge_state(v_a, s_a, v_b, s_b)


def merge_state_(v_a: torch.Tensor, s_a: torch.Tensor, v_b: torch.Tensor, s_b: torch.Tensor) -> None:
    """In-place :func:`merge_state`: the merged result overwrites ``v_a`` and ``s_a``."""
    torch.ops.kdtree.merge_state_(v_a, s_a, v_b, s_b)


# ---- verify attention ----

# ---- tree ops ----

# ---- kv movement ----

_load_cuda()
