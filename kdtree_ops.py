"""kdtree_ops: fast tree-verify ops for MLA models, as PyTorch custom ops.

This module is the build, the op registry and the typed Python API, nothing else. Every op is
declared once here under ``torch.ops.kdtree`` with its schema, a pure-torch CPU reference (the
semantic truth), a fake impl (``torch.compile``, meta tracing) and a wrapper; its CUDA impl is
the ``TORCH_LIBRARY_IMPL(kdtree, CUDA)`` of one file in ``kdtree_ops_src/``, compiled on first
CUDA use (:func:`load`):

=====================================  =========================================================
op (wrapper)                           CUDA impl
=====================================  =========================================================
merge_state, merge_state_              merge_state.cu
verify_attn, verify_attn_out           verify_attn.cu (portable mma.sync kernel, the host
                                       dispatch and the split merge); on sm_90
                                       verify_attn_sm90.cu, verify_attn_sm90_seesaw.cu and
                                       verify_attn_sm90_fp8.cu (+ verify_attn_sm90.cuh)
pack_tree_mask, sglang_mask_to_packed  mask.cu
build_tree                             build_tree.cu (+ build_tree_replay.cuh,
                                       build_tree_levels.cuh)
verify_metadata                        verify_metadata.cu
flat_custom_mask                       flat_custom_mask.cu
accept_walk                            accept_walk.cu
sglang_build_tree_, accept_retrieve    ddtree_sglang.cu
move_kv                                move_kv.cu
guard_errors (not an op: ctypes)       guard.cu (device guards: common.cuh)
draft_topk                             (torch ops only)
=====================================  =========================================================

Environment variables: README.md's table (one parser, :func:`env_flag` / :func:`env_number`,
mirrored by ``env_flag`` in ``kdtree_ops_src/common.cuh``). ``import kdtree_ops`` imports no
other module of this project; with ``KDTREE_VERIFY`` set it installs the SGLang hook
(``sglang_hook``), which patches SGLang only when SGLang itself is imported.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import heapq
import json
import logging
import math
import os
import shutil
import socket
import struct
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import NamedTuple, Optional, Sequence

import torch


__all__ = [
    "MLA_QK_DIM", "MLA_V_DIM", "MAX_TREE_BUDGET", "MAX_TREE_DEPTH",
    "build", "load", "cuda_available", "cache_root", "env_flag", "env_number", "check_mode",
    "guard_errors", "GUARDS",
    "merge_state", "merge_state_",
    "verify_attn", "verify_attn_reference", "k_scale_usable", "pack_tree_mask", "sglang_mask_to_packed",
    "pack_bits", "unpack_bits", "ancestor_mask",
    "Tree", "draft_topk", "build_tree", "VerifyMetadata", "verify_metadata", "flat_custom_mask", "flat_mask_size",
    "accept_walk", "SGLangTree", "sglang_build_tree", "RetrieveAccept", "accept_retrieve",
    "move_kv",
]

SRC_DIR = Path(__file__).resolve().with_name("kdtree_ops_src")
log = logging.getLogger("kdtree_ops")
_lib = torch.library.Library("kdtree", "DEF")  # every schema is defined through this


_TRUE_WORDS, _FALSE_WORDS = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")


def env_flag(name: str, default: bool = False) -> bool:
    """A KDTREE_* switch: 1/true/yes/on or 0/false/no/off (any case); unset is ``default``.
    Anything else warns once and reads as ``default``."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    word = raw.strip().lower()
    if word in _TRUE_WORDS or word in _FALSE_WORDS:
        return word in _TRUE_WORDS
    _warn_env(name, raw, f"not one of {'/'.join(_TRUE_WORDS)} or {'/'.join(w for w in _FALSE_WORDS if w)}", default)
    return default


def env_number(name: str, default, *, minimum=None, kind=int):
    """A numeric KDTREE_* setting (``kind`` int or float), finite and >= ``minimum``; a
    malformed or out-of-range value warns once and reads as ``default``."""
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        value = kind(raw.strip())
    except ValueError:
        _warn_env(name, raw, f"not a valid {kind.__name__}", default)
        return default
    if not math.isfinite(value) or (minimum is not None and value < minimum):
        _warn_env(name, raw, "not finite" if not math.isfinite(value) else f"below {minimum}", default)
        return default
    return value


_ENV_WARNED: set = set()


def _warn_env(name: str, raw: str, why: str, default) -> None:
    if (name, raw) not in _ENV_WARNED:
        _ENV_WARNED.add((name, raw))
        log.warning("kdtree_ops: %s=%r is %s; using %r", name, raw, why, default)


def check_mode() -> bool:
    """True when KDTREE_CHECK asks for device-side validation of indices and masks."""
    return env_flag("KDTREE_CHECK")


# --------------------------------------------------------------------------------------------
# JIT build. Not torch.utils.cpp_extension.load_inline: that compiles one translation unit
# (nothing in parallel) into one folder per name. Here: one ninja file with one object per
# source (parallel), one cache folder per (sources, flags, torch, CUDA runtime, nvcc, arch)
# hash, so ranks of one arch build once and other archs never collide. Builders serialise on
# an flock (released by the kernel when a builder dies, so a killed build blocks nobody),
# compile in a private temporary folder (a killed builder's leftover jobs touch nobody else's
# files) and move the library into place atomically; a BUILT record of its size and hash is
# checked before every load, so a truncated or corrupt library is rebuilt, never dlopen'ed.
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
        # 9.0 builds sm_90a (runs on every H100/H200): the verify-attention wgmma kernel needs it.
        num += "a" if num == "90" else ""
        flags.append(f"-gencode=arch=compute_{num},code=sm_{num}")
    return flags


def _sources() -> list[Path]:
    return sorted(p for p in SRC_DIR.iterdir() if p.suffix in (".cu", ".cuh"))


def _nvcc_version() -> str:
    """The toolkit's version as its version.json states it (no subprocess); "none" without
    a toolkit, whose build then fails with its own message."""
    try:
        info = json.loads((_cuda_home() / "version.json").read_text())
        return str(info.get("cuda_nvcc", info.get("cuda", {})).get("version", "unknown"))
    except (RuntimeError, OSError, ValueError, AttributeError):
        return "none"


def _build_key(archs: list[str]) -> str:
    h = hashlib.sha256()
    for p in _sources():
        h.update(p.name.encode())
        h.update(p.read_bytes())
    for part in (_NVCC_FLAGS, archs, [torch.__version__, str(torch.version.cuda), _nvcc_version()]):
        h.update(repr(part).encode())
    return h.hexdigest()[:16]


def cache_root() -> Path:
    return Path(os.environ.get("KDTREE_CACHE_DIR") or Path.home() / ".cache" / "kdtree_ops")


_LIB_NAME = "kdtree_ops_cuda.so"
_STALE_BUILD_S = 6 * 3600  # private build folders older than this are a dead builder's


def _library_record(lib: Path) -> dict:
    data = lib.read_bytes()
    return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def _built_problem(build_dir: Path) -> Optional[str]:
    """None when ``build_dir`` holds a library matching its BUILT record, else why not."""
    marker, lib = build_dir / "BUILT", build_dir / _LIB_NAME
    if not marker.exists():
        return "not built yet"
    try:
        want = json.loads(marker.read_text())
        got = _library_record(lib)
    except (OSError, ValueError) as e:
        return f"unreadable build ({type(e).__name__}: {e})"
    if not isinstance(want, dict) or got != {k: want.get(k) for k in got}:
        return f"library of {got['size']} bytes does not match its BUILT record ({want})"
    return None


@contextlib.contextmanager
def _build_lock(path: Path):
    """Exclusive flock on ``path``, waited for at most KDTREE_BUILD_WAIT seconds (1800), saying
    once whom it waits for; the holder's pid, host and start time are in the file."""
    import fcntl  # POSIX only: the CPU references stay importable without it

    wait = env_number("KDTREE_BUILD_WAIT", 1800.0, minimum=0.0, kind=float)
    with open(path, "a+") as f:
        deadline, said = time.monotonic() + wait, False
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                f.seek(0)
                holder = f.read().strip() or "another process"
                if time.monotonic() >= deadline:
                    raise RuntimeError(
                        f"kdtree_ops: gave up after {wait:g} s waiting for the build lock {path}, held by {holder}. "
                        "If that process is stopped or hung, end it and retry; KDTREE_BUILD_WAIT sets the wait."
                    ) from None
                if not said:
                    log.warning("kdtree_ops: waiting for the kernel build of %s (%s)", holder, path.parent)
                    said = True
                time.sleep(0.2)
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
        f.flush()
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _prune_stale_builds(build_dir: Path) -> None:
    now = time.time()
    for d in build_dir.glob("tmp-*"):
        try:
            if now - d.stat().st_mtime > _STALE_BUILD_S:
                shutil.rmtree(d, ignore_errors=True)
        except OSError:
            pass


def _write_ninja(build_dir: Path, cuda_home: Path, archs: list[str], lib_name: str) -> None:
    torch_include = Path(torch.__file__).parent / "include"
    includes = [SRC_DIR, torch_include, torch_include / "torch" / "csrc" / "api" / "include", cuda_home / "include"]
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    cflags = _NVCC_FLAGS + _gencode(archs) + [f"-D_GLIBCXX_USE_CXX11_ABI={abi}"]
    cflags += ["-Xptxas=-v"] if env_flag("KDTREE_PTXAS_VERBOSE") else []
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
    lib_path = build_dir / _LIB_NAME
    if _built_problem(build_dir) is None:
        return lib_path  # built before: load without running ninja
    build_dir.mkdir(parents=True, exist_ok=True)
    with _build_lock(build_dir / "lock"):
        problem = _built_problem(build_dir)
        if problem is None:
            return lib_path  # another process built it while we waited
        if problem != "not built yet":
            log.warning("kdtree_ops: rebuilding the kernels in %s: %s", build_dir, problem)
        _prune_stale_builds(build_dir)
        cuda_home = _cuda_home()
        ninja = _ninja()
        archs_txt = ", ".join(f"sm_{a.replace('.', '')}" for a in archs)
        log.warning("kdtree_ops: building CUDA kernels for %s (first use, about a minute) in %s", archs_txt, build_dir)
        work = Path(tempfile.mkdtemp(prefix="tmp-", dir=build_dir))
        try:
            _write_ninja(work, cuda_home, archs, _LIB_NAME)
            jobs = os.environ.get("MAX_JOBS") or str(os.cpu_count() or 4)
            verbose = env_flag("KDTREE_VERBOSE") if verbose is None else verbose
            proc = subprocess.run(
                [ninja, "-j", jobs, "-v"] if verbose else [ninja, "-j", jobs],
                cwd=work,
                stdout=None if verbose else subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            if proc.returncode != 0:
                raise RuntimeError(f"kdtree_ops: building the CUDA kernels failed:\n{proc.stdout or ''}")
            record = _library_record(work / _LIB_NAME)
            os.replace(work / _LIB_NAME, lib_path)
            (work / "BUILT").write_text(json.dumps({**record, "key": key, "archs": archs}) + "\n")
            os.replace(work / "BUILT", build_dir / "BUILT")
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return lib_path


_LOAD_LOCK = threading.RLock()
_LOADED = False
_LOAD_ERROR: Optional[BaseException] = None


def load() -> bool:
    """Build (on first use) and load the CUDA kernels into this process.

    Never called at import: ``import kdtree_ops`` neither initialises CUDA nor asks for a
    device, so it is safe in a ``sitecustomize.py`` that every process of an environment runs
    (tokenizer processes, ranks that have not chosen their GPU yet, processes that fork). It
    runs on first use instead: every op wrapper handed a CUDA tensor, every fake impl tracing
    one (so ``torch.compile``'d graphs find the kernels), and the SGLang hook inside each rank
    once SGLang has set that rank's device. It builds for the current device's arch
    (``KDTREE_CUDA_ARCH`` overrides); ranks of one arch share one cached build.

    Returns
    -------
    bool
        True when the kernels are registered; False without a CUDA GPU or with
        ``KDTREE_NO_BUILD=1``. A failed build raises, and every later call raises the same
        error without building again.
    """
    global _LOADED, _LOAD_ERROR
    if _LOADED:
        return True
    with _LOAD_LOCK:
        if _LOADED:
            return True
        if _LOAD_ERROR is not None:
            raise _LOAD_ERROR
        if env_flag("KDTREE_NO_BUILD") or not torch.cuda.is_available():
            return False
        try:
            lib = build()
            torch.ops.load_library(str(lib))
            global _GUARD_READER
            _GUARD_READER = ctypes.CDLL(str(lib)).kdtree_guard_errors
            _GUARD_READER.argtypes, _GUARD_READER.restype = [ctypes.c_int], ctypes.c_int
            _GUARD_READER(0)  # allocates the guard table now, never inside a graph capture
        except BaseException as e:
            _LOAD_ERROR = e
            raise
        _LOADED = True
        return True


_GUARD_READER = None
# Bit order of kdtree::Guard (common.cuh).
GUARDS = (
    "kv_indices outside kv_cache (verify_attn)",
    "malformed qo_indptr/kv_indptr or nodes past tree_mask (verify_attn)",
    "rows outside custom_mask (sglang_mask_to_packed)",
    "slots outside the pool (move_kv)",
    "k_scale not a positive normal float, or tree_k beyond 65504 x k_scale (verify_attn, fp8 kv_cache)",
)


def guard_errors(clear: bool = True) -> list[str]:
    """The device guards tripped since the last clear, read without synchronising.

    CUDA kernels never check index values on the host (that would sync, and cannot run
    inside a CUDA graph). Instead a kernel that meets an out-of-range index or a malformed
    indptr reads and writes nothing outside its tensors, gives the affected output a defined
    value (NaN rows for verify_attn, cleared bits for sglang_mask_to_packed, a skipped pair
    for move_kv) and sets a flag in host-mapped memory. Flags of kernels still queued appear
    once they ran; ``torch.cuda.synchronize()`` first to see everything launched so far.

    Returns
    -------
    list of str
        One entry per tripped guard (see ``GUARDS``); empty when none tripped or the kernels
        are not loaded.
    """
    if _GUARD_READER is None:
        return []
    bits = _GUARD_READER(1 if clear else 0)
    return [name for i, name in enumerate(GUARDS) if bits >> i & 1]


def cuda_available() -> bool:
    """True when the CUDA kernels can run in this process (loads them on first call, see
    :func:`load`)."""
    return load()


def _cuda_kernels_for(*args) -> None:
    """Load the kernels before the first op on a CUDA tensor (one flag test once loaded)."""
    if _LOADED:
        return
    for a in args:
        for t in a if isinstance(a, (list, tuple)) else (a,):
            if isinstance(t, torch.Tensor) and t.is_cuda:
                load()
                return


def _define(schema: str):
    """Declare an op from its schema and register `fn` as its CPU reference impl."""
    name = schema.split("(", 1)[0]
    _lib.define(schema)

    def register(fn):
        _lib.impl(name, fn, "CPU")
        return fn

    return register


def _fake(name: str):
    """Register `fn` as the fake impl of ``kdtree::name``. Tracing CUDA tensors loads the
    kernels, which the compiled graph then calls at run time."""

    def register(fn):
        @functools.wraps(fn)
        def fake(*args, **kwargs):
            _cuda_kernels_for(*args, *kwargs.values())
            return fn(*args, **kwargs)

        torch.library.register_fake(f"kdtree::{name}")(fake)
        return fn

    return register


# --------------------------------------------------------------------------------------------
# The argument contract, one per op, the same on every device. Host checks (dtypes, shapes,
# devices, layouts, host ints) read no tensor data: the CPU reference, the fake impl and the
# wrapper run them, before the CUDA impl's own C++ checks, so both devices raise the same
# error. Value checks (index ranges, monotonic indptrs, mask coverage) read the data: the CPU
# reference runs them always, the wrapper on CUDA tensors only under KDTREE_CHECK=1 (a host
# sync). Every message names the argument and what it must be.
# --------------------------------------------------------------------------------------------

_INDEX_DTYPES = (torch.int32, torch.int64)
_INT64_MAX = 2**63 - 1


def _check(cond, message) -> None:
    """torch._check with a fast path for the plain bools of eager calls (torch._check costs
    microseconds per call, and a wrapper runs dozens per op); symbolic conditions, while a
    fake impl traces, go to torch._check."""
    if cond is True:
        return
    if cond is False:
        raise RuntimeError(message())
    torch._check(cond, message)


def _check_int(name: str, value, lo: int, hi: Optional[int] = None) -> None:
    """A host int bound to a schema ``int`` (int64), in [lo, hi] (hi None: up to int64's
    largest): checked here, since the binding's own error for a Python int past int64 names
    neither the argument nor the range."""
    _check(isinstance(value, (int, torch.SymInt)) and not isinstance(value, bool),
                 lambda: f"kdtree: {name} must be an int, got {type(value).__name__}")
    _check(lo <= value and value <= (_INT64_MAX if hi is None else hi),
                 lambda: f"kdtree: {name} must be " + (f">= {lo} (an int64)" if hi is None else f"in [{lo}, {hi}]") + f", got {value}")


def _check_on(t: torch.Tensor, name: str, like: torch.Tensor, like_name: str) -> None:
    _check(t.device == like.device, lambda: f"kdtree: {name} must be on {like.device} like {like_name}, got {t.device}")


def _check_index_vector(t: torch.Tensor, name: str) -> None:
    _check(t.dim() == 1 and t.dtype in _INDEX_DTYPES,
                 lambda: f"kdtree: {name} must be 1-D int32 or int64, got {t.dtype} {tuple(t.shape)}")
    _check(t.is_contiguous(), lambda: f"kdtree: {name} must be contiguous, got strides {t.stride()}")


def _check_contiguous(t: torch.Tensor, name: str) -> None:
    _check(t.is_contiguous(), lambda: f"kdtree: {name} must be contiguous, got strides {t.stride()}")


def _check_last_contiguous(t: torch.Tensor, name: str) -> None:
    _check(t.dim() == 0 or t.stride(-1) == 1 or t.shape[-1] <= 1,
                 lambda: f"kdtree: {name} must be contiguous in its last dim, got strides {t.stride()}")


def _fail(message: str):
    raise RuntimeError("kdtree: " + message)


def _check_indptr_values(ptr: torch.Tensor, name: str, end: Optional[int] = None, end_what: str = "",
                         at_most: Optional[int] = None, at_most_what: str = "") -> list:
    """Value check: ``ptr`` starts at 0, never decreases and ends at ``end`` (or at most at
    ``at_most``); returns its entries as host ints."""
    p = ptr.tolist()
    if p[0] != 0:
        _fail(f"{name} must start at 0, got {name}[0] = {p[0]}")
    for i in range(1, len(p)):
        if p[i] < p[i - 1]:
            _fail(f"{name} must never decrease, got {name}[{i}] = {p[i]} < {name}[{i - 1}] = {p[i - 1]}")
    if end is not None and p[-1] != end:
        _fail(f"{name}[-1] must be {end} ({end_what}), got {p[-1]}")
    if at_most is not None and p[-1] > at_most:
        _fail(f"{name}[-1] must be at most {at_most} ({at_most_what}), got {p[-1]}")
    return p


def _check_range_values(t: torch.Tensor, name: str, lo: int, hi: Optional[int], what: str) -> None:
    """Value check: every entry of ``t`` lies in [lo, hi) (hi None: >= lo)."""
    bad = (t < lo) if hi is None else (t < lo) | (t >= hi)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        want = f"be >= {lo}" if hi is None else f"lie in [{lo}, {hi})"
        _fail(f"{name} must {want} ({what}), got {name}[{i}] = {int(t[i])}")


def _eager() -> bool:
    """Whether a wrapper runs the host checks itself: not while torch.compile traces it (Dynamo
    cannot trace the checks' messages; the fake impl runs the same checks on the traced shapes)."""
    return not torch.compiler.is_compiling()


def _checked_by_the_op(call, check_args):
    """``call()``, an op whose every impl checks its arguments itself (the CUDA impl in C++, the
    CPU and fake impls through ``check_args``), so that an eager wrapper need not check them
    first: on an H100 the Python checks took 13 of an eager verify_attn call's 35 us. Where the
    op refuses its arguments, ``check_args`` names what is wrong in the words the CPU impl uses,
    so a bad argument reads the same on every device."""
    if not _eager():
        return call()
    try:
        return call()
    except (RuntimeError, TypeError, IndexError):
        try:
            check_args()
        except RuntimeError as refused:
            raise refused from None
        raise


def _value_checks(t: torch.Tensor) -> bool:
    """Whether a wrapper runs the value checks on ``t``'s device: on CUDA under KDTREE_CHECK=1
    (the CPU reference runs them itself), never while torch.compile traces it."""
    return t.is_cuda and _eager() and check_mode()


# --------------------------------------------------------------------------------------------
# merge_state: LSE merge of two partial attention results
# --------------------------------------------------------------------------------------------


def _merge_state_math(v_a, s_a, v_b, s_b):
    acc = torch.promote_types(v_a.dtype, torch.float32)
    invalid = torch.isnan(s_a) | torch.isnan(s_b) | (s_a == math.inf) | (s_b == math.inf)
    s_a, s_b = torch.where(invalid, -math.inf, s_a), torch.where(invalid, -math.inf, s_b)
    m = torch.maximum(s_a, s_b)
    m0 = torch.where(m > -math.inf, m, torch.zeros_like(m))
    w_a, w_b = torch.exp(s_a - m0), torch.exp(s_b - m0)  # exactly 0 for an empty partial
    total = w_a + w_b
    inv = torch.where(total > 0, 1.0 / total, torch.zeros_like(total))

    def term(v, w):  # an empty partial's values are never read: they may be anything
        return torch.where((w > 0)[..., None], v.to(acc) * (w * inv)[..., None], torch.zeros((), dtype=acc))

    v = torch.where(invalid[..., None], torch.full((), math.nan, dtype=acc), term(v_a, w_a) + term(v_b, w_b))
    s = torch.where(total > 0, m0 + torch.log(total), torch.full_like(m, -math.inf))
    return v.to(v_a.dtype), torch.where(invalid, math.nan, s).to(s_a.dtype)


def _check_merge_args(v_a, s_a, v_b, s_b):
    _check(v_a.dtype in (torch.float32, torch.bfloat16, torch.float16),
                 lambda: f"kdtree: v_a must be float32, bfloat16 or float16, got {v_a.dtype}")
    for name, v, s in (("a", v_a, s_a), ("b", v_b, s_b)):
        _check(v.dim() == 3, lambda: f"kdtree: v_{name} must be [T, H, D], got {tuple(v.shape)}")
        _check(v.shape == v_a.shape, lambda: f"kdtree: v_{name} must have shape {tuple(v_a.shape)}, got {tuple(v.shape)}")
        _check(v.dtype == v_a.dtype, lambda: f"kdtree: v_{name} must be {v_a.dtype} like v_a, got {v.dtype}")
        _check(s.dtype == torch.float32, lambda: f"kdtree: s_{name} must be float32, got {s.dtype}")
        _check(s.shape == v_a.shape[:2], lambda: f"kdtree: s_{name} must have shape {tuple(v_a.shape[:2])}, got {tuple(s.shape)}")
        _check_last_contiguous(v, f"v_{name}")
        _check_on(v, f"v_{name}", v_a, "v_a")
        _check_on(s, f"s_{name}", v_a, "v_a")


@_define("merge_state(Tensor v_a, Tensor s_a, Tensor v_b, Tensor s_b) -> (Tensor, Tensor)")
def _merge_state_cpu(v_a, s_a, v_b, s_b):
    _check_merge_args(v_a, s_a, v_b, s_b)
    return _merge_state_math(v_a, s_a, v_b, s_b)


@_fake("merge_state")
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


@_fake("merge_state_")
def _merge_state_inplace_fake(v_a, s_a, v_b, s_b):
    _check_merge_args(v_a, s_a, v_b, s_b)


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

    Non-finite log-sum-exps, identically on CPU and CUDA: ``-inf`` marks an empty partial,
    whose values are never read (they may be anything); a NaN or ``+inf`` in either partial
    makes that row's ``v`` and ``s`` NaN. NaN values of a non-empty partial propagate.
    """
    if _eager():
        _check_merge_args(v_a, s_a, v_b, s_b)
    _cuda_kernels_for(v_a)
    return torch.ops.kdtree.merge_state(v_a, s_a, v_b, s_b)


def merge_state_(v_a: torch.Tensor, s_a: torch.Tensor, v_b: torch.Tensor, s_b: torch.Tensor) -> None:
    """In-place :func:`merge_state`: the merged result overwrites ``v_a`` and ``s_a``."""
    if _eager():
        _check_merge_args(v_a, s_a, v_b, s_b)
    _cuda_kernels_for(v_a)
    torch.ops.kdtree.merge_state_(v_a, s_a, v_b, s_b)


# ---- verify attention ----

MLA_QK_DIM, MLA_V_DIM = 576, 512


def _rows_2d(t: torch.Tensor) -> torch.Tensor:
    """[S, 576] view of an [S, 576] or [S, 1, 576] latent tensor."""
    return t.reshape(t.shape[0], t.shape[-1]) if t.dim() == 3 else t


_FP8_KV_DTYPES = (torch.float8_e4m3fn, torch.uint8)  # uint8: e4m3 bytes, as SGLang stores fp8 pools


def _check_verify_args(q, kv_cache, kv_indptr, kv_indices, qo_indptr, tree_k, tree_mask, out=None, lse=None,
                       k_scale=None, k_scale_value=1.0):
    _check(q.dim() == 3 and q.shape[2] == MLA_QK_DIM and q.shape[1] >= 1,
                 lambda: f"kdtree: q must be [T, H >= 1, 576], got {tuple(q.shape)}")
    _check(q.dtype in (torch.bfloat16, torch.float16), lambda: f"kdtree: q must be bfloat16 or float16, got {q.dtype}")
    _check_last_contiguous(q, "q")
    for name, t in (("kv_cache", kv_cache), ("tree_k", tree_k)):
        _check(
            (t.dim() == 2 and t.shape[1] == MLA_QK_DIM) or (t.dim() == 3 and t.shape[1] == 1 and t.shape[2] == MLA_QK_DIM),
            lambda: f"kdtree: {name} must be [S, 576] or [S, 1, 576], got {tuple(t.shape)}",
        )
        _check_last_contiguous(t, name)
    fp8 = kv_cache.dtype in _FP8_KV_DTYPES
    _check(kv_cache.dtype == q.dtype or fp8, lambda: f"kdtree: kv_cache must be {q.dtype} like q, or float8_e4m3fn / "
           f"uint8 (e4m3 bytes), got {kv_cache.dtype}")
    _check(tree_k.dtype == q.dtype, lambda: f"kdtree: tree_k must be {q.dtype} like q, got {tree_k.dtype}")
    _check_k_scale(k_scale, k_scale_value, kv_cache, q)
    _check(tree_k.shape[0] == q.shape[0], lambda: f"kdtree: tree_k must have {q.shape[0]} rows like q, got {tree_k.shape[0]}")
    for name, t in (("kv_indptr", kv_indptr), ("qo_indptr", qo_indptr), ("kv_indices", kv_indices)):
        _check_index_vector(t, name)
    _check(kv_indptr.shape[0] >= 1, lambda: "kdtree: kv_indptr must have batch + 1 >= 1 entries, got 0")
    _check(kv_indptr.shape == qo_indptr.shape, lambda: f"kdtree: qo_indptr must have batch + 1 = {kv_indptr.shape[0]} entries like kv_indptr, got {qo_indptr.shape[0]}")
    if tree_mask is not None:
        _check(tree_mask.dim() == 2 and tree_mask.dtype == torch.int32 and tree_mask.shape[0] == q.shape[0] and tree_mask.shape[1] >= 1,
                     lambda: f"kdtree: tree_mask must be int32 [{q.shape[0]}, ceil(max_nodes/32)], got {tree_mask.dtype} {tuple(tree_mask.shape)}")
        _check_last_contiguous(tree_mask, "tree_mask")
    T, H = q.shape[0], q.shape[1]
    if out is not None:
        _check(tuple(out.shape) == (T, H, MLA_V_DIM), lambda: f"kdtree: out must be [{T}, {H}, {MLA_V_DIM}], got {tuple(out.shape)}")
        _check(out.dtype == q.dtype, lambda: f"kdtree: out must be {q.dtype} like q, got {out.dtype}")
        _check_last_contiguous(out, "out")
    if lse is not None:
        _check(tuple(lse.shape) == (T, H), lambda: f"kdtree: lse must be [{T}, {H}], got {tuple(lse.shape)}")
        _check(lse.dtype == torch.float32, lambda: f"kdtree: lse must be float32, got {lse.dtype}")
    for name, t in (("kv_cache", kv_cache), ("kv_indptr", kv_indptr), ("kv_indices", kv_indices), ("qo_indptr", qo_indptr),
                    ("tree_k", tree_k), ("tree_mask", tree_mask), ("out", out), ("lse", lse), ("k_scale", k_scale)):
        if t is not None:
            _check_on(t, name, q, "q")


def _check_k_scale(k_scale, k_scale_value, kv_cache, q):
    """The op's two scale arguments: a tensor (read on the device) or a host float, and only
    for an fp8 kv_cache (a bf16/fp16 pool holds unscaled rows; 1.0 is the value's default)."""
    _check_scale_has_fp8_pool(k_scale is not None or k_scale_value != 1.0, kv_cache)
    if k_scale is not None:
        _check(k_scale.dtype == torch.float32 and k_scale.dim() <= 1 and k_scale.numel() == 1,
               lambda: f"kdtree: k_scale must be a float32 tensor of one element, got {k_scale.dtype} {tuple(k_scale.shape)}")
    if isinstance(k_scale_value, float):  # a traced SymFloat is checked when the call runs eagerly
        _check(k_scale_usable(k_scale_value), lambda: f"kdtree: {_K_SCALE_RULE}, got {k_scale_value}")


def _check_scale_has_fp8_pool(scale_given: bool, kv_cache):
    _check(not scale_given or kv_cache.dtype in _FP8_KV_DTYPES,
           lambda: f"kdtree: k_scale applies to an fp8 kv_cache only (kv_cache is {kv_cache.dtype})")


# The CUDA kernels divide by k_scale in float32 (tree rows into the pool's units).
_K_SCALE_RULE = "k_scale must be finite and positive (a normal float32, >= 2^-126)"
_F32_TINY, _F32_MAX = 2.0**-126, float(torch.finfo(torch.float32).max)


def k_scale_usable(value: float) -> bool:
    """Whether ``value`` is a k_scale verify_attn takes for an fp8 kv_cache: finite and
    positive once rounded to float32, at least 2^-126 (the CUDA kernels divide by it)."""
    try:  # as the kernels read it: rounded to float32
        as_f32 = struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:
        return False
    return _F32_TINY <= as_f32 <= _F32_MAX


def _k_scale_op_args(k_scale, kv_cache):
    """The wrapper's ``k_scale`` as the op's (k_scale, k_scale_value); eagerly, its Python
    type, and that one given at all needs an fp8 kv_cache (the op alone cannot tell an explicit
    1.0 from the default)."""
    if _eager() and k_scale is not None:
        _check(isinstance(k_scale, (torch.Tensor, float, int)) and not isinstance(k_scale, bool),
               lambda: f"kdtree: k_scale must be None, a float or a float32 tensor of one element, got {type(k_scale).__name__}")
        _check_scale_has_fp8_pool(True, kv_cache)
    if isinstance(k_scale, torch.Tensor):
        return k_scale, 1.0
    if isinstance(k_scale, int):
        return None, float(k_scale)
    return None, 1.0 if k_scale is None else k_scale


def _check_verify_values(q, kv_cache, kv_indptr, kv_indices, qo_indptr, tree_mask, k_scale=None):
    """Value check: indptrs from 0, non-decreasing, covering q's rows and within kv_indices;
    every used slot a row of kv_cache; every request's nodes within tree_mask's words; a
    k_scale tensor's value usable (k_scale_usable)."""
    kvp = _check_indptr_values(kv_indptr, "kv_indptr", at_most=kv_indices.shape[0], at_most_what="len(kv_indices)")
    qo = _check_indptr_values(qo_indptr, "qo_indptr", end=q.shape[0], end_what="rows of q")
    _check_range_values(kv_indices[: kvp[-1]], "kv_indices", 0, kv_cache.shape[0], "rows of kv_cache")
    if tree_mask is not None:
        nodes = max(b - a for a, b in zip(qo, qo[1:])) if len(qo) > 1 else 0
        if nodes > 32 * tree_mask.shape[1]:
            _fail(f"tree_mask must have at least {-(-nodes // 32)} words per row (a request has {nodes} nodes), "
                  f"got {tree_mask.shape[1]}")
    if k_scale is not None:
        value = k_scale.item()
        if not k_scale_usable(value):
            _fail(f"{_K_SCALE_RULE}, got {value}")


def unpack_bits(words: torch.Tensor, n: int) -> torch.Tensor:
    """[R, W] int32 packed rows -> [R, n] bool (bit j % 32 of word j // 32)."""
    j = torch.arange(n, device=words.device)
    have = j // 32 < words.shape[1]
    w = words[:, (j // 32).clamp_max(max(words.shape[1] - 1, 0))].long() if words.shape[1] else torch.zeros(words.shape[0], n, dtype=torch.long)
    return ((w >> (j % 32)) & 1).bool() & have


def _prefix_rows(kv: torch.Tensor, slots: torch.Tensor, acc: torch.dtype, k_scale) -> torch.Tensor:
    """Rows ``slots`` of the [S, 576] pool in ``acc``: an fp8 pool's e4m3 values times k_scale
    (rounded to float32 first, as the kernels read it), any other pool's values as they are."""
    if kv.dtype not in _FP8_KV_DTYPES:
        return kv[slots].to(acc)
    scale = torch.as_tensor(k_scale, dtype=torch.float32).reshape(()).to(device=kv.device, dtype=acc)
    return kv.view(torch.uint8)[slots].view(torch.float8_e4m3fn).to(acc) * scale


def verify_attn_reference(q, kv_cache, kv_indptr, kv_indices, qo_indptr, tree_k, tree_mask, sm_scale, *, k_scale=1.0):
    """Reference: per request, softmax over (all prefix keys) + (tree keys under the mask).
    Prefix rows of an fp8 ``kv_cache`` (float8_e4m3fn, or uint8 holding e4m3 bytes) are
    dequantized (times ``k_scale``, a float or a one-element tensor) into the accumulation
    dtype (float64 for float64 q, else float32); tree_k is used as it is."""
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    T, H, _ = q.shape
    kv, tk = _rows_2d(kv_cache), _rows_2d(tree_k)
    out = torch.zeros(T, H, MLA_V_DIM, dtype=acc, device=q.device)
    lse = torch.full((T, H), -math.inf, dtype=acc, device=q.device)
    qo, kvp = qo_indptr.tolist(), kv_indptr.tolist()
    for b in range(len(qo) - 1):
        q0, q1, k0, k1 = qo[b], qo[b + 1], kvp[b], kvp[b + 1]
        n = q1 - q0
        if n == 0:
            continue
        keys = torch.cat([_prefix_rows(kv, kv_indices[k0:k1].long(), acc, k_scale), tk[q0:q1].to(acc)])
        scores = torch.einsum("nhd,kd->nhk", q[q0:q1].to(acc), keys) * sm_scale
        if tree_mask is None:
            visible = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        else:
            visible = unpack_bits(tree_mask[q0:q1], n)
        scores[:, :, k1 - k0 :] = scores[:, :, k1 - k0 :].masked_fill(~visible[:, None, :], -math.inf)
        row_lse = torch.logsumexp(scores, -1)
        finite = torch.isfinite(row_lse)
        probs = torch.exp(scores - torch.where(finite, row_lse, torch.zeros_like(row_lse))[..., None])
        out[q0:q1] = torch.einsum("nhk,kd->nhd", probs, keys[:, :MLA_V_DIM])
        lse[q0:q1] = row_lse
    return out.to(q.dtype), lse.to(torch.float32 if acc == torch.float32 else acc)


@_define(
    "verify_attn(Tensor q, Tensor kv_cache, Tensor kv_indptr, Tensor kv_indices, Tensor qo_indptr, "
    "Tensor tree_k, Tensor? tree_mask, float sm_scale, int max_kv_len=-1, Tensor? k_scale=None, "
    "float k_scale_value=1.0) -> (Tensor, Tensor)"
)
def _verify_attn_cpu(q, kv_cache, kv_indptr, kv_indices, qo_indptr, tree_k, tree_mask, sm_scale, max_kv_len=-1,
                     k_scale=None, k_scale_value=1.0):
    _check_verify_args(q, kv_cache, kv_indptr, kv_indices, qo_indptr, tree_k, tree_mask, k_scale=k_scale,
                       k_scale_value=k_scale_value)
    _check_verify_values(q, kv_cache, kv_indptr, kv_indices, qo_indptr, tree_mask, k_scale)
    return verify_attn_reference(q, kv_cache, kv_indptr, kv_indices, qo_indptr, tree_k, tree_mask, sm_scale,
                                 k_scale=k_scale_value if k_scale is None else k_scale)


@_fake("verify_attn")
def _verify_attn_fake(q, kv_cache, kv_indptr, kv_indices, qo_indptr, tree_k, tree_mask, sm_scale, max_kv_len=-1,
                      k_scale=None, k_scale_value=1.0):
    _check_verify_args(q, kv_cache, kv_indptr, kv_indices, qo_indptr, tree_k, tree_mask, k_scale=k_scale,
                       k_scale_value=k_scale_value)
    T, H, _ = q.shape
    return q.new_empty(T, H, MLA_V_DIM), q.new_empty(T, H, dtype=torch.float32)


@_define(
    "verify_attn_out(Tensor q, Tensor kv_cache, Tensor kv_indptr, Tensor kv_indices, Tensor qo_indptr, "
    "Tensor tree_k, Tensor? tree_mask, float sm_scale, Tensor(a!) out, Tensor(b!) lse, int max_kv_len=-1, "
    "Tensor? k_scale=None, float k_scale_value=1.0) -> ()"
)
def _verify_attn_out_cpu(q, kv_cache, kv_indptr, kv_indices, qo_indptr, tree_k, tree_mask, sm_scale, out, lse,
                         max_kv_len=-1, k_scale=None, k_scale_value=1.0):
    _check_verify_args(q, kv_cache, kv_indptr, kv_indices, qo_indptr, tree_k, tree_mask, out, lse, k_scale, k_scale_value)
    _check_verify_values(q, kv_cache, kv_indptr, kv_indices, qo_indptr, tree_mask, k_scale)
    o, s = verify_attn_reference(q, kv_cache, kv_indptr, kv_indices, qo_indptr, tree_k, tree_mask, sm_scale,
                                 k_scale=k_scale_value if k_scale is None else k_scale)
    out.copy_(o)
    lse.copy_(s)


@_fake("verify_attn_out")
def _verify_attn_out_fake(q, kv_cache, kv_indptr, kv_indices, qo_indptr, tree_k, tree_mask, sm_scale, out, lse,
                          max_kv_len=-1, k_scale=None, k_scale_value=1.0):
    _check_verify_args(q, kv_cache, kv_indptr, kv_indices, qo_indptr, tree_k, tree_mask, out, lse, k_scale, k_scale_value)


def verify_attn(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    qo_indptr: torch.Tensor,
    tree_k: torch.Tensor,
    tree_mask: Optional[torch.Tensor],
    sm_scale: float,
    *,
    out: Optional[torch.Tensor] = None,
    lse: Optional[torch.Tensor] = None,
    max_kv_len: Optional[int] = None,
    k_scale: Optional[float | torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tree-verify attention for MLA over page-size-1 KV.

    Request b's tree nodes are rows ``qo_indptr[b]:qo_indptr[b+1]`` of q. Every node sees all
    of the request's prefix slots ``kv_indices[kv_indptr[b]:kv_indptr[b+1]]`` and, among the
    request's own nodes, those its tree_mask row allows (or itself and earlier nodes when
    tree_mask is None: a causal chain). Scores are ``sm_scale * q.k`` over 576 dims; values are
    the first 512 dims of the same rows.

    An fp8 kv_cache (SGLang's ``--kv-cache-dtype fp8_e4m3`` pool, which stores k / k_scale)
    is read as e4m3 values times ``k_scale``, for keys and values alike; tree_k is never
    scaled. The CUDA kernels multiply the e4m3 values themselves in float16 tensor-core math
    (e4m3 -> float16 is exact) and apply k_scale in float32, to the scores and the output; a
    bfloat16 q enters float16 times a power of two (exact), and tree_k enters divided by
    k_scale (one float16 rounding). So on CUDA a tree_k value must lie within
    65504 x k_scale (146 times the pool's own e4m3 range): beyond it that request's rows come
    out NaN and ``guard_errors()`` reports it.

    On CUDA a Hopper kernel serves sm_90 (``KDTREE_VERIFY_WGMMA=0`` and
    ``KDTREE_VERIFY_SEESAW=0`` pick the others: README.md's table), and the portable kernel every
    other GPU. Its CTAs take 64, 48 or 16 (node, head) rows of a request. When T is a multiple of
    the batch size B, requests of T / B nodes take 16 if they have at most 16 rows (16 heads x 1
    node), else 48 if 64-row tiles would cover at least 1.2 times the rows 48-row ones do (16
    heads x 9 nodes: 192 rows against 144); otherwise 64. Over an fp8 pool, requests that take
    16 rows run on the portable kernel on sm_90 too (faster there than on 64-row tiles), in a
    variant that stages the next tile's e4m3 bytes where the grid has more CTAs than two per
    SM (three of it fit an H200 SM). The shapes alone decide. ``KDTREE_VERIFY_ROWS=16``,
    ``48`` or ``64`` forces one (48 or 64 keeps sm_90's fp8 requests on the Hopper kernel).
    On sm_90 a 16-bit pool's 64-key tiles whose slots are consecutive pool rows (a page of a
    paged pool, a run an allocator handed out) load as tensor-map boxes, checked on the device
    tile by tile, wherever ``max_kv_len`` does not cut the prefix below 256 keys a split;
    ``KDTREE_VERIFY_TMA=0`` copies every row by slot. On both the seesaw and the portable
    kernel a batch of several requests runs on the balanced schedule: every SM takes an equal share of the whole batch's keys (for
    each row tile), which may end one request and start the next, and the shares' partial
    results are merged, so requests of unequal lengths take their total work over the SMs,
    where equal splits of each request wait on the longest one's. Only a batch of equal trees
    whose equal splits fill one wave of SMs to 95% keeps equal splits;
    ``KDTREE_VERIFY_BALANCE=0`` or ``1`` forces the choice.
    Over an fp8 pool, requests of at least 9 row tiles of 64 on the Hopper kernel first have
    every prefix row widened once into a float16 workspace (at most 1 GiB), which the kernel
    then reads as a 16-bit pool's, with the same numerics and output bits as when it widens
    each row itself; ``KDTREE_VERIFY_FP8_WIDEN=0`` or ``1`` forces the choice.
    Each variable is read at every call, so also when a CUDA graph is captured.

    Parameters
    ----------
    q : Tensor [T, H, 576], bfloat16 or float16
        Absorbed queries (512 nope + 64 rope) of all requests' tree nodes.
    kv_cache : Tensor [S, 576] or [S, 1, 576], q's dtype, float8_e4m3fn or uint8
        The layer's latent KV pool; uint8 rows are e4m3 bytes (how SGLang stores fp8 pools).
        CUDA needs 16-byte aligned rows, fewer than 2^31 of them.
    kv_indptr : Tensor [B + 1], int32 or int64
        Prefix boundaries into kv_indices per request.
    kv_indices : Tensor [>= kv_indptr[-1]], int32 or int64
        Prefix slots (rows of kv_cache), in token order.
    qo_indptr : Tensor [B + 1], int32 or int64 (independently of kv_indptr)
        Row boundaries of each request's nodes in q (node 0 = root).
    tree_k : Tensor [T, 576] or [T, 1, 576], q's dtype
        The nodes' own latents (their keys/values), unscaled.
    tree_mask : Tensor [T, W] int32 or None
        Bit ``j % 32`` of word ``j // 32`` of row i set = node i sees node j of its request
        (local indices); W >= ceil(max nodes per request / 32). None = causal chain.
    sm_scale : float
        Softmax scale.
    out : Tensor [T, H, 512], q's dtype, optional
        Written in place (may be a strided view, e.g. SGLang's ``o.view(T, H, 512)``).
    lse : Tensor [T, H], float32, optional
        Written in place.
    max_kv_len : int, optional
        Upper bound of any request's prefix length (a host int); lets the kernel split
        short prefixes less. Never read from the device, so CUDA-graph capture is safe.
    k_scale : float, or Tensor [] or [1] float32 on q's device, optional
        Dequantization scale of an fp8 kv_cache (SGLang's ``layer.k_scale``); None means 1.0,
        and only an fp8 kv_cache takes one. Either form is rounded to float32. A tensor is
        read on the device at every launch, so a captured CUDA graph replays with its current
        value; it must be finite and positive, at least 2^-126 (checked on CPU, on CUDA with
        ``KDTREE_CHECK=1``; otherwise NaN rows and ``guard_errors()``).

    Returns
    -------
    out : Tensor [T, H, 512], q's dtype
    lse : Tensor [T, H], float32, natural-log log-sum-exp of each row's scores
        (``-inf`` for a row that sees nothing; its output is 0).
    """
    scale_t, scale_v = _k_scale_op_args(k_scale, kv_cache)

    def check_args():
        _check_verify_args(q, kv_cache, kv_indptr, kv_indices, qo_indptr, tree_k, tree_mask, out, lse, scale_t, scale_v)

    if _eager() and max_kv_len is not None:
        _check_int("max_kv_len", max_kv_len, 0)
    if _value_checks(q):
        check_args()  # the value checks read the arguments as valid
        _check_verify_values(q, kv_cache, kv_indptr, kv_indices, qo_indptr, tree_mask, scale_t)
    _cuda_kernels_for(q)
    hint = -1 if max_kv_len is None else max_kv_len

    def call():
        if out is None and lse is None:
            return torch.ops.kdtree.verify_attn(q, kv_cache, kv_indptr, kv_indices, qo_indptr, tree_k, tree_mask,
                                                sm_scale, hint, scale_t, scale_v)
        o = q.new_empty(q.shape[0], q.shape[1], MLA_V_DIM) if out is None else out
        s = q.new_empty(q.shape[0], q.shape[1], dtype=torch.float32) if lse is None else lse
        torch.ops.kdtree.verify_attn_out(q, kv_cache, kv_indptr, kv_indices, qo_indptr, tree_k, tree_mask, sm_scale, o, s,
                                         hint, scale_t, scale_v)
        return o, s

    return _checked_by_the_op(call, check_args)


def pack_bits(mask: torch.Tensor, words: int) -> torch.Tensor:
    """[R, N] bool -> [R, words] int32 with bit j % 32 of word j // 32 = mask[:, j]."""
    R, N = mask.shape
    padded = torch.zeros(R, words * 32, dtype=torch.int64, device=mask.device)
    padded[:, :N] = mask.to(torch.int64)
    vals = (padded.view(R, words, 32) << torch.arange(32, device=mask.device)).sum(-1)
    return torch.where(vals >= 2**31, vals - 2**32, vals).to(torch.int32)


def ancestor_mask(parents, num_nodes: Optional[int] = None) -> torch.Tensor:
    """[N, N] bool: row i marks node i and its ancestors (parents precede children; -1 = no
    parent). Rows from ``num_nodes`` on (unused slots) are all False.

    Parameters
    ----------
    parents : Tensor [N] (any integer dtype) or list of int
    num_nodes : int, optional
        Nodes in use (default N).
    """
    par = parents.tolist() if isinstance(parents, torch.Tensor) else list(parents)
    N = len(par)
    mask = torch.zeros(N, N, dtype=torch.bool)
    for i in range(N if num_nodes is None else num_nodes):
        if par[i] >= 0:
            mask[i] = mask[par[i]]
        mask[i, i] = True
    return mask


def _check_pack_tree_mask_args(mask):
    _check(mask.dim() == 2 and mask.dtype in (torch.bool, torch.uint8),
                 lambda: f"kdtree: mask must be bool or uint8 [T, N], got {mask.dtype} {tuple(mask.shape)}")
    _check_last_contiguous(mask, "mask")


@_define("pack_tree_mask(Tensor mask) -> Tensor")
def _pack_tree_mask_cpu(mask):
    _check_pack_tree_mask_args(mask)
    return pack_bits(mask != 0, max(1, -(-mask.shape[1] // 32)))


@_fake("pack_tree_mask")
def _pack_tree_mask_fake(mask):
    _check_pack_tree_mask_args(mask)
    return mask.new_empty(mask.shape[0], max(1, -(-mask.shape[1] // 32)), dtype=torch.int32)


def _check_sglang_mask_args(custom_mask, mask_indptr, qo_indptr, kv_indptr, num_rows, max_nodes):
    _check(custom_mask.dim() == 1 and custom_mask.dtype in (torch.bool, torch.uint8),
                 lambda: f"kdtree: custom_mask must be 1-D bool or uint8, got {custom_mask.dtype} {tuple(custom_mask.shape)}")
    _check_contiguous(custom_mask, "custom_mask")
    for name, t in (("mask_indptr", mask_indptr), ("qo_indptr", qo_indptr), ("kv_indptr", kv_indptr)):
        _check_index_vector(t, name)
        _check(t.shape[0] == qo_indptr.shape[0] and t.shape[0] >= 1,
                     lambda: f"kdtree: {name} must have batch + 1 = {qo_indptr.shape[0]} >= 1 entries like qo_indptr, got {t.shape[0]}")
        _check_on(t, name, custom_mask, "custom_mask")
    _check_int("num_rows", num_rows, 0)
    _check_int("max_nodes", max_nodes, 1)


def _check_sglang_mask_values(custom_mask, mask_indptr, qo_indptr, kv_indptr, num_rows, max_nodes):
    """Value check: indptrs from 0 and non-decreasing, every request within num_rows rows and
    max_nodes nodes, and its block within custom_mask."""
    qo = _check_indptr_values(qo_indptr, "qo_indptr", at_most=num_rows, at_most_what="num_rows")
    kvp = _check_indptr_values(kv_indptr, "kv_indptr")
    mip = _check_indptr_values(mask_indptr, "mask_indptr")
    for b in range(len(qo) - 1):
        n, prefix = qo[b + 1] - qo[b], kvp[b + 1] - kvp[b]
        if n > max_nodes:
            _fail(f"max_nodes must be at least every request's node count, got {max_nodes} but request {b} has {n}")
        if mip[b] + n * (prefix + n) > custom_mask.shape[0]:
            _fail(f"custom_mask must hold request {b}'s {n} x {prefix + n} block from mask_indptr[{b}] = {mip[b]}, "
                  f"got {custom_mask.shape[0]} entries")


@_define(
    "sglang_mask_to_packed(Tensor custom_mask, Tensor mask_indptr, Tensor qo_indptr, Tensor kv_indptr, "
    "int num_rows, int max_nodes) -> Tensor"
)
def _sglang_mask_to_packed_cpu(custom_mask, mask_indptr, qo_indptr, kv_indptr, num_rows, max_nodes):
    _check_sglang_mask_args(custom_mask, mask_indptr, qo_indptr, kv_indptr, num_rows, max_nodes)
    _check_sglang_mask_values(custom_mask, mask_indptr, qo_indptr, kv_indptr, num_rows, max_nodes)
    words = -(-max_nodes // 32)
    out = torch.zeros(num_rows, words, dtype=torch.int32)
    qo, kvp, mip = qo_indptr.tolist(), kv_indptr.tolist(), mask_indptr.tolist()
    for b in range(len(qo) - 1):
        n, prefix = qo[b + 1] - qo[b], kvp[b + 1] - kvp[b]
        block = custom_mask[mip[b] : mip[b] + n * (prefix + n)].view(n, prefix + n)[:, prefix:]
        out[qo[b] : qo[b + 1]] = pack_bits(block != 0, words)
    return out


@_fake("sglang_mask_to_packed")
def _sglang_mask_to_packed_fake(custom_mask, mask_indptr, qo_indptr, kv_indptr, num_rows, max_nodes):
    _check_sglang_mask_args(custom_mask, mask_indptr, qo_indptr, kv_indptr, num_rows, max_nodes)
    return qo_indptr.new_empty(num_rows, -(-max_nodes // 32), dtype=torch.int32)


def pack_tree_mask(mask: torch.Tensor) -> torch.Tensor:
    """Pack a node-visibility mask for :func:`verify_attn`.

    Parameters
    ----------
    mask : Tensor [T, N], bool or uint8
        ``mask[i, j]`` true = row i (a tree node) sees node j of its own request.

    Returns
    -------
    Tensor [T, ceil(N / 32)], int32: bit ``j % 32`` of word ``j // 32`` = ``mask[i, j]``.
    """
    if _eager():
        _check_pack_tree_mask_args(mask)
    _cuda_kernels_for(mask)
    return torch.ops.kdtree.pack_tree_mask(mask)


def sglang_mask_to_packed(
    custom_mask: torch.Tensor,
    mask_indptr: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    *,
    num_rows: Optional[int] = None,
    max_nodes: Optional[int] = None,
) -> torch.Tensor:
    """Convert SGLang's flat TARGET_VERIFY custom mask to packed tree-mask rows.

    Parameters
    ----------
    custom_mask : Tensor [total], bool or uint8
        Request b's block starts at ``mask_indptr[b]``: nodes rows x (prefix + nodes) columns,
        row-major; the tree part starts at column ``prefix``.
    mask_indptr : Tensor [B + 1], int32 or int64
        Block starts; each block must lie within custom_mask.
    qo_indptr : Tensor [B + 1], int32 or int64
        Rows (tree nodes) per request, from 0, non-decreasing, ending at most at num_rows.
    kv_indptr : Tensor [B + 1], int32 or int64
        Prefix lengths per request (prefix only, as in SGLang's TARGET_VERIFY metadata).
    num_rows, max_nodes : int, optional
        T and the largest node count; pass them (host ints) under CUDA-graph capture. When
        omitted they are read from qo_indptr, which syncs the host.

    Returns
    -------
    Tensor [num_rows, ceil(max_nodes / 32)], int32, the layout :func:`verify_attn` reads.
    """
    if num_rows is None or max_nodes is None:
        qo = qo_indptr.long().cpu()
        if num_rows is None:
            num_rows = int(qo[-1]) if qo.numel() else 0
        if max_nodes is None:
            max_nodes = max(1, int((qo[1:] - qo[:-1]).max())) if qo.numel() > 1 else 1
    if _eager():
        _check_sglang_mask_args(custom_mask, mask_indptr, qo_indptr, kv_indptr, num_rows, max_nodes)
    if _value_checks(custom_mask):
        _check_sglang_mask_values(custom_mask, mask_indptr, qo_indptr, kv_indptr, num_rows, max_nodes)
    _cuda_kernels_for(custom_mask)
    return torch.ops.kdtree.sglang_mask_to_packed(custom_mask, mask_indptr, qo_indptr, kv_indptr, num_rows, max_nodes)

# ---- tree ops ----
# DDTree (Ringel & Romano 2026, arXiv 2604.12989): draft top-k, best-first tree build (the top-budget
# prefixes of the drafter's per-position top-K), verify metadata, accept walk.

MAX_TREE_BUDGET = 1024  # nodes per tree besides the root; N = budget + 1 <= 1025
MAX_TREE_DEPTH = 31  # draft positions L


class Tree(NamedTuple):
    """A batch of draft trees in fixed-capacity slots (N = budget + 1 per request).

    Node 0 is the root, nodes 1.. are in pop order of the best-first build, so every parent
    precedes its children. Slots ``num_nodes[b] <= i < N`` are unused: token 0 (a valid id, so
    padded slots can go through an embedding), parent -1, depth 0, mask row all zero.

    Attributes
    ----------
    tokens : Tensor [B, N], int64
    parents : Tensor [B, N], int32 (-1 for the root and unused slots)
    depths : Tensor [B, N], int32 (root 0)
    num_nodes : Tensor [B], int32 (root included)
    mask : Tensor [B, N, ceil(N / 32)], int32
        Packed ancestor mask: bit ``j % 32`` of word ``j // 32`` of row ``i`` is set when node
        ``i`` may see node ``j`` (``j`` is ``i`` or one of its ancestors).
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    num_nodes: torch.Tensor
    mask: torch.Tensor


_F32 = struct.Struct("<f")


def _f32_add(a: float, b: float) -> float:
    """a + b rounded to float32 for float32 a and b (the double sum rounds exactly once more:
    53 >= 2 * 24 + 2 bits, so the result is the correctly rounded float32 sum)."""
    s = a + b
    try:
        return _F32.unpack(_F32.pack(s))[0]
    except OverflowError:  # rounds beyond the float32 range
        return math.copysign(math.inf, s)


def _build_tree_one(lp: list[list[float]], tok: list[list[int]], root: int, budget: int, keff: int):
    """The paper's best-first build with heapq, float32 scores accumulated in depth order.

    Heap entries are (-score, rank tuple, parent node, depth, rank); rank tuples are distinct,
    so ties in score are broken by the tuple, lexicographically, and nothing else is compared.
    """
    L, N = len(lp), budget + 1
    tokens, parents, depths, score = [0] * N, [-1] * N, [0] * N, [0.0] * N
    tokens[0] = root
    heap = [(-_f32_add(0.0, lp[0][0]), (0,), 0, 1, 0)]
    n = 1
    while n <= budget and heap:
        neg, ranks, p, d, r = heapq.heappop(heap)
        tokens[n], parents[n], depths[n], score[n] = tok[d - 1][r], p, d, -neg
        if r + 1 < keff:  # next sibling
            heapq.heappush(heap, (-_f32_add(score[p], lp[d - 1][r + 1]), ranks[:-1] + (r + 1,), p, d, r + 1))
        if d < L:  # first child
            heapq.heappush(heap, (-_f32_add(score[n], lp[d][0]), ranks + (0,), n, d + 1, 0))
        n += 1
    return tokens, parents, depths, n


def _check_build_tree_args(topk_logprobs, topk_tokens, root_tokens, budget):
    _check(topk_logprobs.dim() == 3, lambda: f"kdtree: topk_logprobs must be [B, L, K], got {tuple(topk_logprobs.shape)}")
    _check(topk_logprobs.dtype == torch.float32, lambda: f"kdtree: topk_logprobs must be float32, got {topk_logprobs.dtype}")
    _check(
        topk_tokens.dtype in (torch.int32, torch.int64),
        lambda: f"kdtree: topk_tokens must be int32 or int64, got {topk_tokens.dtype}",
    )
    _check(
        topk_tokens.shape == topk_logprobs.shape,
        lambda: f"kdtree: topk_tokens must have shape {tuple(topk_logprobs.shape)} like topk_logprobs, got {tuple(topk_tokens.shape)}",
    )
    B, L, K = topk_logprobs.shape
    _check(root_tokens.dtype == torch.int64, lambda: f"kdtree: root_tokens must be int64, got {root_tokens.dtype}")
    _check(root_tokens.shape == (B,), lambda: f"kdtree: root_tokens must have shape ({B},), got {tuple(root_tokens.shape)}")
    _check_int("budget", budget, 1, MAX_TREE_BUDGET)
    _check(1 <= L <= MAX_TREE_DEPTH, lambda: f"kdtree: topk_logprobs must have 1 to {MAX_TREE_DEPTH} positions (dim 1), got {L}")
    _check(K >= 1, lambda: f"kdtree: topk_logprobs must have at least one rank (dim 2), got {K}")
    for name, t in (("topk_logprobs", topk_logprobs), ("topk_tokens", topk_tokens), ("root_tokens", root_tokens)):
        _check_contiguous(t, name)
        _check_on(t, name, topk_logprobs, "topk_logprobs")


def _check_sorted_logprobs(topk_logprobs):
    """Value check: no NaN, and each position's ranks sorted descending (what the best-first
    build takes as the order of a node's children)."""
    nan = torch.isnan(topk_logprobs)
    if bool(nan.any()):
        b, l, k = nan.nonzero()[0].tolist()
        _fail(f"topk_logprobs must not be NaN, got topk_logprobs[{b}, {l}, {k}] = nan")
    up = topk_logprobs[..., 1:] > topk_logprobs[..., :-1]
    if bool(up.any()):
        b, l, k = up.nonzero()[0].tolist()
        _fail(f"topk_logprobs must be sorted descending along dim 2, got topk_logprobs[{b}, {l}, {k}:{k + 2}] = "
              f"{topk_logprobs[b, l, k:k + 2].tolist()}")


@_define("build_tree(Tensor topk_logprobs, Tensor topk_tokens, Tensor root_tokens, int budget) -> (Tensor, Tensor, Tensor, Tensor, Tensor)")
def _build_tree_cpu(topk_logprobs, topk_tokens, root_tokens, budget):
    _check_build_tree_args(topk_logprobs, topk_tokens, root_tokens, budget)
    _check_sorted_logprobs(topk_logprobs)
    return _build_tree_reference(topk_logprobs, topk_tokens, root_tokens, budget)


def _build_tree_reference(topk_logprobs, topk_tokens, root_tokens, budget):
    """The heap build on whatever log-probs it is given (the CUDA build replays the same heap,
    unsorted ranks included)."""
    B, L, K = topk_logprobs.shape
    N, W = budget + 1, (budget + 32) // 32
    keff = min(K, budget)
    lp_all = topk_logprobs[:, :, :keff].tolist()
    tok_all = topk_tokens[:, :, :keff].tolist()
    roots = root_tokens.tolist()
    tokens, parents, depths, num_nodes, mask = [], [], [], [], []
    for b in range(B):
        t, p, d, n = _build_tree_one(lp_all[b], tok_all[b], roots[b], budget, keff)
        tokens.append(t)
        parents.append(p)
        depths.append(d)
        num_nodes.append(n)
        mask.append(pack_bits(ancestor_mask(p, n), W))
    dev = topk_logprobs.device
    return (
        torch.tensor(tokens, dtype=torch.int64, device=dev).view(B, N),
        torch.tensor(parents, dtype=torch.int32, device=dev).view(B, N),
        torch.tensor(depths, dtype=torch.int32, device=dev).view(B, N),
        torch.tensor(num_nodes, dtype=torch.int32, device=dev).view(B),
        (torch.stack(mask) if B else torch.empty(0, N, W, dtype=torch.int32)).to(dev),
    )


@_fake("build_tree")
def _build_tree_fake(topk_logprobs, topk_tokens, root_tokens, budget):
    _check_build_tree_args(topk_logprobs, topk_tokens, root_tokens, budget)
    B, N = topk_logprobs.shape[0], budget + 1
    new = topk_logprobs.new_empty
    return (
        new((B, N), dtype=torch.int64),
        new((B, N), dtype=torch.int32),
        new((B, N), dtype=torch.int32),
        new((B,), dtype=torch.int32),
        new((B, N, (N + 31) // 32), dtype=torch.int32),
    )


def build_tree(
    topk_logprobs: torch.Tensor, topk_tokens: torch.Tensor, root_tokens: torch.Tensor, budget: int
) -> Tree:
    """Build the DDTree draft tree of every request: its ``budget`` most probable prefixes.

    Best-first, exactly as the paper's heap: node scores are float32 sums of log-probs in depth
    order, ties broken by rank tuple (lexicographic, a prefix first); only the top
    ``min(K, budget)`` ranks per position are used. The tree has ``min(budget, number of
    possible prefixes)`` nodes besides the root. Log-probs must not be NaN and must be sorted
    descending per position (checked on the CPU, and on CUDA under ``KDTREE_CHECK=1``).

    Parameters
    ----------
    topk_logprobs : Tensor [B, L, K], float32, contiguous
        Per draft position (1 <= L <= 31), the top-K log-probs sorted descending.
    topk_tokens : Tensor [B, L, K], int32 or int64, contiguous
        Their token ids.
    root_tokens : Tensor [B], int64
        Each tree's root (the previous step's bonus token).
    budget : int
        Nodes besides the root, 1 to 1024; N = budget + 1.

    Returns
    -------
    Tree
        ``tokens [B, N]`` int64, ``parents [B, N]`` int32, ``depths [B, N]`` int32,
        ``num_nodes [B]`` int32, ``mask [B, N, ceil(N / 32)]`` int32 (see :class:`Tree`).
    """
    if _eager():
        _check_build_tree_args(topk_logprobs, topk_tokens, root_tokens, budget)
    if _value_checks(topk_logprobs):
        _check_sorted_logprobs(topk_logprobs)
    _cuda_kernels_for(topk_logprobs)
    return Tree(*torch.ops.kdtree.build_tree(topk_logprobs, topk_tokens, root_tokens, budget))


def draft_topk(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k log-probs of the drafter's per-position logits: :func:`build_tree`'s inputs.

    Plain torch ops (top-k of the logits minus their float32 log-sum-exp), so capturable in a
    CUDA graph and traceable by ``torch.compile``.

    Parameters
    ----------
    logits : Tensor [B, L, V], float32 / bfloat16 / float16
    k : int
        Ranks to keep, 1 <= k <= V.

    Returns
    -------
    topk_logprobs : Tensor [B, L, k], float32, sorted descending (log-softmax values)
    topk_tokens : Tensor [B, L, k], int64
    """
    if _eager():
        _check(logits.dim() == 3 and logits.dtype in (torch.float32, torch.bfloat16, torch.float16),
                     lambda: f"kdtree: logits must be float32, bfloat16 or float16 [B, L, V], got {logits.dtype} {tuple(logits.shape)}")
        _check_int("k", k, 1, logits.shape[-1])
    values, tokens = torch.topk(logits, k, dim=-1, largest=True, sorted=True)
    lse = torch.logsumexp(logits.float(), dim=-1, keepdim=True)
    return values.float() - lse, tokens


class VerifyMetadata(NamedTuple):
    """What the target's tree-verify forward needs besides the tree (see :func:`verify_metadata`).

    Attributes
    ----------
    positions : Tensor [B * N], int64
        ``prefix_len + depth`` per node (``prefix_len`` for unused slots).
    qo_indptr : Tensor [B + 1], int32
        ``arange(B + 1) * N``: every request is padded to N query rows.
    custom_mask : Tensor [capacity], bool, or None
        SGLang's flat mask: request b's block starts at ``mask_indptr[b]`` and is N rows of
        ``prefix_len_b + N`` columns, row-major; prefix columns True, then the tree row.
        Entries from ``mask_indptr[B]`` to ``capacity`` are False.
    mask_indptr : Tensor [B + 1], int64, or None
        Exclusive cumulative sum of ``N * (prefix_len + N)``.
    retrieve_index : Tensor [B, N], int64, or None
        ``b * N + i``.
    retrieve_next_token : Tensor [B, N], int64, or None
        Each node's first (lowest-index) child, -1 if none.
    retrieve_next_sibling : Tensor [B, N], int64, or None
        The next higher-index child of the same parent, -1 if none (and for root/unused).
    """

    positions: torch.Tensor
    qo_indptr: torch.Tensor
    custom_mask: Optional[torch.Tensor]
    mask_indptr: Optional[torch.Tensor]
    retrieve_index: Optional[torch.Tensor]
    retrieve_next_token: Optional[torch.Tensor]
    retrieve_next_sibling: Optional[torch.Tensor]


def _check_per_request(t, name, like, like_name):
    """A [B] int32/int64 per-request tensor (B = like.shape[0]) on like's device."""
    B = like.shape[0]
    _check(t.dtype in (torch.int32, torch.int64), lambda: f"kdtree: {name} must be int32 or int64, got {t.dtype}")
    _check(t.shape == (B,), lambda: f"kdtree: {name} must have shape ({B},), got {tuple(t.shape)}")
    _check_contiguous(t, name)
    _check_on(t, name, like, like_name)


def _check_prefix_values(prefix_lens):
    _check_range_values(prefix_lens, "prefix_lens", 0, None, "token counts")


def _check_tree_tensor(t, name, like, dtype):
    _check(t.dtype == dtype, lambda: f"kdtree: {name} must be {dtype}, got {t.dtype}")
    _check(t.shape == like.shape, lambda: f"kdtree: {name} must have shape {tuple(like.shape)}, got {tuple(t.shape)}")
    _check_contiguous(t, name)
    _check_on(t, name, like, "the tree")


# Tree tensors the CUDA kernels stage per request in 48 KB of shared memory.
_MAX_STAGED_NODES = 12 * 1024


def _check_verify_metadata_args(depths, parents, prefix_lens):
    _check(depths.dim() == 2, lambda: f"kdtree: depths must be [B, N], got {tuple(depths.shape)}")
    _check_tree_tensor(depths, "depths", depths, torch.int32)
    _check_tree_tensor(parents, "parents", depths, torch.int32)
    _check(1 <= depths.shape[1] <= _MAX_STAGED_NODES,
                 lambda: f"kdtree: depths must have 1 to {_MAX_STAGED_NODES} nodes (dim 1), got {depths.shape[1]}")
    _check_per_request(prefix_lens, "prefix_lens", depths, "the tree")


@_define("verify_metadata(Tensor depths, Tensor parents, Tensor prefix_lens, bool retrieve) -> (Tensor, Tensor, Tensor, Tensor, Tensor)")
def _verify_metadata_cpu(depths, parents, prefix_lens, retrieve):
    _check_verify_metadata_args(depths, parents, prefix_lens)
    _check_prefix_values(prefix_lens)
    B, N = depths.shape
    positions = (prefix_lens.to(torch.int64)[:, None] + depths.to(torch.int64)).reshape(-1)
    qo_indptr = (torch.arange(B + 1, dtype=torch.int32) * N).to(depths.device)
    if not retrieve:
        empty = depths.new_empty((0,), dtype=torch.int64)
        return positions, qo_indptr, empty, empty.clone(), empty.clone()
    index = torch.arange(B * N, dtype=torch.int64).view(B, N)
    first_child, next_sibling = [], []
    for par in parents.tolist():
        head, sib = [-1] * N, [-1] * N
        for i in range(N - 1, -1, -1):  # prepend, last to first, like sglang's tree kernel
            p = par[i]
            if 0 <= p < N:
                sib[i], head[p] = head[p], i
        first_child.append(head)
        next_sibling.append(sib)
    as_tensor = lambda x: torch.tensor(x, dtype=torch.int64).view(B, N).to(depths.device)
    return positions, qo_indptr, index.to(depths.device), as_tensor(first_child), as_tensor(next_sibling)


@_fake("verify_metadata")
def _verify_metadata_fake(depths, parents, prefix_lens, retrieve):
    _check_verify_metadata_args(depths, parents, prefix_lens)
    B, N = depths.shape
    rshape = (B, N) if retrieve else (0,)
    new = depths.new_empty
    return (
        new((B * N,), dtype=torch.int64),
        new((B + 1,), dtype=torch.int32),
        new(rshape, dtype=torch.int64),
        new(rshape, dtype=torch.int64),
        new(rshape, dtype=torch.int64),
    )


def _check_flat_custom_mask_args(mask, prefix_lens, capacity, num_nodes=None):
    _check(mask.dim() == 3, lambda: f"kdtree: mask must be [B, N, W], got {tuple(mask.shape)}")
    _check(mask.dtype == torch.int32, lambda: f"kdtree: mask must be int32, got {mask.dtype}")
    B, N, W = mask.shape
    _check(
        1 <= N <= MAX_TREE_BUDGET + 1,
        lambda: f"kdtree: mask must have 1 to {MAX_TREE_BUDGET + 1} nodes (dim 1), got {N}",
    )
    _check(W == (N + 31) // 32, lambda: f"kdtree: mask must have {(N + 31) // 32} words per row (dim 2), got {W}")
    _check_contiguous(mask, "mask")
    _check_per_request(prefix_lens, "prefix_lens", mask, "the tree")
    _check_int("capacity", capacity, 0)
    if num_nodes is not None:
        _check_per_request(num_nodes, "num_nodes", mask, "mask")


@_define("flat_custom_mask(Tensor mask, Tensor prefix_lens, int capacity, Tensor? num_nodes=None) -> (Tensor, Tensor)")
def _flat_custom_mask_cpu(mask, prefix_lens, capacity, num_nodes=None):
    _check_flat_custom_mask_args(mask, prefix_lens, capacity, num_nodes)
    _check_prefix_values(prefix_lens)
    B, N, W = mask.shape
    j = torch.arange(N)
    bits = ((mask[:, :, j // 32] >> (j % 32)) & 1).bool()  # [B, N, N]
    lens = prefix_lens.to(torch.int64)
    live = [N] * B if num_nodes is None else num_nodes.to(torch.int64).clamp(0, N).tolist()
    mask_indptr = torch.zeros(B + 1, dtype=torch.int64)
    mask_indptr[1:] = torch.cumsum(N * (lens + N), 0)
    out = torch.zeros(capacity, dtype=torch.bool)
    for b, (P, n) in enumerate(zip(lens.tolist(), live)):
        block = torch.zeros(N, P + N, dtype=torch.bool)
        block[:n, :P] = True
        block[:n, P : P + n] = bits[b, :n, :n]
        start = int(mask_indptr[b])
        end = min(start + block.numel(), capacity)
        if start < end:
            out[start:end] = block.reshape(-1)[: end - start]
    return out.to(mask.device), mask_indptr.to(mask.device)


@_fake("flat_custom_mask")
def _flat_custom_mask_fake(mask, prefix_lens, capacity, num_nodes=None):
    _check_flat_custom_mask_args(mask, prefix_lens, capacity, num_nodes)
    return mask.new_empty((capacity,), dtype=torch.bool), mask.new_empty((mask.shape[0] + 1,), dtype=torch.int64)


def flat_mask_size(prefix_lens_sum: int, batch: int, num_slots: int) -> int:
    """Entries of SGLang's flat custom mask: ``N * (sum(prefix_lens) + B * N)``, N = num_slots."""
    return num_slots * (prefix_lens_sum + batch * num_slots)


def verify_metadata(
    tree: Tree,
    prefix_lens: torch.Tensor,
    *,
    retrieve: bool = False,
    custom_mask_capacity: Optional[int] = None,
) -> VerifyMetadata:
    """Positions and masks for verifying ``tree`` with the target; O(B * N^2) work.

    Parameters
    ----------
    tree : Tree
        From :func:`build_tree` (or any tree with the same layout).
    prefix_lens : Tensor [B], int32 or int64
        Tokens in each request's KV cache before the root (>= 0).
    retrieve : bool
        Also return EAGLE's ``retrieve_index / retrieve_next_token / retrieve_next_sibling``
        (the arrays sglang's ``verify_tree_greedy`` consumes; children in index order).
    custom_mask_capacity : int, optional
        Also build SGLang's flat ``custom_mask`` into a buffer of this many entries. Its real
        size, :func:`flat_mask_size`, depends on device data, so the caller passes a bound
        (a host int; no sync here); if the bound is too small the mask is truncated.

    Returns
    -------
    VerifyMetadata
        ``positions [B*N]`` int64, ``qo_indptr [B+1]`` int32, and when requested
        ``custom_mask [capacity]`` bool + ``mask_indptr [B+1]`` int64 and the three
        ``retrieve_* [B, N]`` int64 arrays (None otherwise).
    """
    if _eager():
        _check_verify_metadata_args(tree.depths, tree.parents, prefix_lens)
        if custom_mask_capacity is not None:
            _check_flat_custom_mask_args(tree.mask, prefix_lens, custom_mask_capacity)
    if _value_checks(prefix_lens):
        _check_prefix_values(prefix_lens)
    _cuda_kernels_for(tree.depths)
    positions, qo_indptr, r_index, r_next, r_sibling = torch.ops.kdtree.verify_metadata(
        tree.depths, tree.parents, prefix_lens, retrieve
    )
    custom_mask = mask_indptr = None
    if custom_mask_capacity is not None:
        custom_mask, mask_indptr = torch.ops.kdtree.flat_custom_mask(tree.mask, prefix_lens, custom_mask_capacity)
    if not retrieve:
        r_index = r_next = r_sibling = None
    return VerifyMetadata(positions, qo_indptr, custom_mask, mask_indptr, r_index, r_next, r_sibling)


def _check_accept_walk_args(parents, tokens, target_tokens, max_depth):
    _check(parents.dim() == 2, lambda: f"kdtree: parents must be [B, N], got {tuple(parents.shape)}")
    _check_tree_tensor(parents, "parents", parents, torch.int32)
    _check_tree_tensor(tokens, "tokens", parents, torch.int64)
    _check_tree_tensor(target_tokens, "target_tokens", parents, torch.int64)
    N = parents.shape[1]
    _check(
        1 <= N <= MAX_TREE_BUDGET + 1,
        lambda: f"kdtree: parents must have 1 to {MAX_TREE_BUDGET + 1} nodes (dim 1), got {N}",
    )
    _check_int("max_depth", max_depth, 0, 2**31 - 2)


@_define("accept_walk(Tensor parents, Tensor tokens, Tensor target_tokens, int max_depth) -> (Tensor, Tensor, Tensor)")
def _accept_walk_cpu(parents, tokens, target_tokens, max_depth):
    _check_accept_walk_args(parents, tokens, target_tokens, max_depth)
    B, N = parents.shape
    accepted = torch.full((B, max_depth + 1), -1, dtype=torch.int32)
    accept_len = torch.zeros(B, dtype=torch.int32)
    bonus = torch.zeros(B, dtype=torch.int64)
    for b, (par, tok, tgt) in enumerate(zip(parents.tolist(), tokens.tolist(), target_tokens.tolist())):
        path = [0]
        while len(path) <= max_depth:
            cur = path[-1]
            nxt = next((j for j in range(1, N) if par[j] == cur and tok[j] == tgt[cur]), None)
            if nxt is None:
                break
            path.append(nxt)
        accepted[b, : len(path)] = torch.tensor(path, dtype=torch.int32)
        accept_len[b] = len(path)
        bonus[b] = tgt[path[-1]]
    dev = parents.device
    return accepted.to(dev), accept_len.to(dev), bonus.to(dev)


@_fake("accept_walk")
def _accept_walk_fake(parents, tokens, target_tokens, max_depth):
    _check_accept_walk_args(parents, tokens, target_tokens, max_depth)
    B = parents.shape[0]
    new = parents.new_empty
    return new((B, max_depth + 1), dtype=torch.int32), new((B,), dtype=torch.int32), new((B,), dtype=torch.int64)


def accept_walk(
    tree: Tree, target_tokens: torch.Tensor, max_depth: Optional[int] = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Walk each tree along the target's tokens (DDTree's verify walk; lossless at any temperature).

    From the root with ``next = target_tokens[b, 0]``: while some child of the current node
    carries ``next``, move to it (the lowest-index such child when several do) and set
    ``next`` to its target token; at most ``max_depth`` moves.

    Parameters
    ----------
    tree : Tree
    target_tokens : Tensor [B, N], int64
        The target's token per node (argmax, or a sample at temperature > 0).
    max_depth : int, optional
        Capacity of the walk; default ``N - 1``, which always suffices. Pass the draft length L
        for ``[B, L + 1]`` outputs (a tree never is deeper than L).

    Returns
    -------
    accepted : Tensor [B, max_depth + 1], int32
        Visited node indices, root first, padded with -1.
    accept_len : Tensor [B], int32
        Visited nodes, root included (>= 1).
    bonus : Tensor [B], int64
        The final ``next``: the target's token after the last accepted node.
    """
    depth = tree.parents.shape[1] - 1 if max_depth is None else max_depth
    if _eager():
        _check_accept_walk_args(tree.parents, tree.tokens, target_tokens, depth)
    _cuda_kernels_for(tree.parents)
    return torch.ops.kdtree.accept_walk(tree.parents, tree.tokens, target_tokens, depth)


def flat_custom_mask(
    mask: torch.Tensor, prefix_lens: torch.Tensor, capacity: int, num_nodes: Optional[torch.Tensor] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """SGLang's flat TARGET_VERIFY ``custom_mask`` from packed tree rows.

    Parameters
    ----------
    mask : Tensor [B, N, ceil(N / 32)], int32, contiguous
        Packed visibility rows (:class:`Tree`'s ``mask``, or :func:`pack_tree_mask` of bool rows).
    prefix_lens : Tensor [B], int32 or int64
        Tokens before the tree per request.
    capacity : int
        Entries of the output (a host int, so no sync); :func:`flat_mask_size` is the exact size.
        A smaller capacity truncates, a larger one is padded with False.
    num_nodes : Tensor [B], int32 or int64, optional
        Live rows per request. Rows ``i >= num_nodes[b]`` are all False (their prefix columns too)
        and so are tree columns ``j >= num_nodes[b]``: the layout of a padded tree whose unused
        slots must see nothing. Default: every row is live.

    Returns
    -------
    custom_mask : Tensor [capacity], bool
        Request b's block starts at ``mask_indptr[b]``: N rows of ``prefix_len_b + N`` columns,
        prefix columns True (live rows), then the tree row.
    mask_indptr : Tensor [B + 1], int64
    """
    if _eager():
        _check_flat_custom_mask_args(mask, prefix_lens, capacity, num_nodes)
    if _value_checks(prefix_lens):
        _check_prefix_values(prefix_lens)
    _cuda_kernels_for(mask)
    return torch.ops.kdtree.flat_custom_mask(mask, prefix_lens, capacity, num_nodes)


# ---- SGLang's DDTree (PR #29907): its tree, its acceptance ----
#
# SGLang's DDTree worker builds its trees with its own rules, which differ from build_tree's: a
# float64 best-first heap whose children get a depth bonus, candidates off the all-rank-0 spine
# pruned below the first score minus log(budget) minus a margin, and the result relabelled
# breadth-first. sglang_build_tree reproduces those trees exactly (the hook swaps it in), and
# accept_retrieve does its greedy acceptance on the EAGLE retrieve arrays the worker verifies with.


class SGLangTree(NamedTuple):
    """A batch of trees in the DDTree worker's layout (D = budget + 1 slots, node 0 the root).

    Nodes 1 .. tree_sizes[b] - 1 are in breadth-first order: by depth, within a depth by the
    parent's index, siblings in the order the heap created them.

    Attributes
    ----------
    node_tokens : Tensor [B, budget], int64
        Token of node i + 1; 0 past the tree.
    node_depths : Tensor [B, budget], int64
        Depth (1-based) of node i + 1; 0 past the tree.
    parents : Tensor [B, D], int64
        Parent node; -1 for the root and past the tree.
    visibility : Tensor [B, D, D], bool
        Node i sees node j (j is i or an ancestor of i); False past the tree.
    tree_sizes : Tensor [B], int64
        Nodes including the root.
    """

    node_tokens: torch.Tensor
    node_depths: torch.Tensor
    parents: torch.Tensor
    visibility: torch.Tensor
    tree_sizes: torch.Tensor


def _sglang_tree_one(lp, tok, budget: int, depth_bonus: float, log_budget: float, stop_margin: float):
    """One request's heap build and relabel; lp and tok are [L][K] Python lists, lp's floats the
    float32 log-probs (exact as doubles), so every sum below is float64 as in the worker."""
    L, K = len(lp), len(lp[0])
    root_score = lp[0][0]
    floor = root_score - log_budget - stop_margin
    # Heap key: (-score, rank tuple). Rank tuples are unique, so nothing after them is compared.
    heap = [(-root_score, (0,), 0, root_score)]
    parent, depth, rank, children = [-1], [0], [0], [[]]
    while heap and len(parent) <= budget:
        _, ranks, p, score = heapq.heappop(heap)
        d, r = len(ranks), ranks[-1]
        if any(ranks) and score < floor:
            continue  # pruned: off the spine and too unlikely; it spawns nothing
        node = len(parent)
        parent.append(p)
        depth.append(d)
        rank.append(r)
        children.append([])
        children[p].append(node)
        if r + 1 < K:
            s = score - lp[d - 1][r] + lp[d - 1][r + 1]
            heapq.heappush(heap, (-s, ranks[:-1] + (r + 1,), p, s))
        if d < L:
            s = score + lp[d][0] + depth_bonus
            heapq.heappush(heap, (-s, ranks + (0,), node, s))
    order = [0]  # breadth-first: a queue that appends each node's children in creation order
    for node in order:
        order.extend(children[node])
    new = {old: i for i, old in enumerate(order)}
    return (
        [tok[depth[o] - 1][rank[o]] for o in order[1:]],
        [depth[o] for o in order[1:]],
        [-1] + [new[parent[o]] for o in order[1:]],
    )


def _check_sglang_tree_args(topk_logprobs, topk_tokens, budget, chain, outs):
    _check(topk_logprobs.dim() == 3, lambda: f"kdtree: topk_logprobs must be [B, L, K], got {tuple(topk_logprobs.shape)}")
    _check(topk_logprobs.dtype == torch.float32, lambda: f"kdtree: topk_logprobs must be float32, got {topk_logprobs.dtype}")
    _check(topk_tokens.dtype == torch.int64, lambda: f"kdtree: topk_tokens must be int64, got {topk_tokens.dtype}")
    _check(
        topk_tokens.shape == topk_logprobs.shape,
        lambda: f"kdtree: topk_tokens must have shape {tuple(topk_logprobs.shape)} like topk_logprobs, got {tuple(topk_tokens.shape)}",
    )
    B, L, K = topk_logprobs.shape
    _check_int("budget", budget, 1, MAX_TREE_BUDGET)
    _check(1 <= L <= MAX_TREE_DEPTH, lambda: f"kdtree: topk_logprobs must have 1 to {MAX_TREE_DEPTH} positions (dim 1), got {L}")
    _check(1 <= K <= (2**31 - 1) // MAX_TREE_DEPTH,
                 lambda: f"kdtree: topk_logprobs must have 1 to {(2**31 - 1) // MAX_TREE_DEPTH} ranks (dim 2), got {K}")
    for name, t in (("topk_logprobs", topk_logprobs), ("topk_tokens", topk_tokens)):
        _check_contiguous(t, name)
        _check_on(t, name, topk_logprobs, "topk_logprobs")
    _check(not chain or budget == L, lambda: f"kdtree: chain needs budget == L, got budget {budget}, L {L}")
    D = budget + 1
    shapes = ((B, budget), (B, budget), (B, D), (B, D, D), (B,))
    dtypes = (torch.int64, torch.int64, torch.int64, torch.bool, torch.int64)
    for name, t, shape, dtype in zip(SGLangTree._fields, outs, shapes, dtypes):
        _check(tuple(t.shape) == shape, lambda: f"kdtree: {name} must have shape {shape}, got {tuple(t.shape)}")
        _check(t.dtype == dtype, lambda: f"kdtree: {name} must be {dtype}, got {t.dtype}")
        _check_contiguous(t, name)
        _check_on(t, name, topk_logprobs, "topk_logprobs")


@_define(
    "sglang_build_tree_(Tensor topk_logprobs, Tensor topk_tokens, int budget, float depth_bonus, float log_budget, "
    "float stop_margin, bool chain, Tensor(a!) node_tokens, Tensor(b!) node_depths, Tensor(c!) parents, "
    "Tensor(d!) visibility, Tensor(e!) tree_sizes) -> ()"
)
def _sglang_build_tree_cpu(topk_logprobs, topk_tokens, budget, depth_bonus, log_budget, stop_margin, chain,
                           node_tokens, node_depths, parents, visibility, tree_sizes):
    outs = (node_tokens, node_depths, parents, visibility, tree_sizes)
    _check_sglang_tree_args(topk_logprobs, topk_tokens, budget, chain, outs)
    L = topk_logprobs.shape[1]
    lp_all, tok_all = topk_logprobs.tolist(), topk_tokens.tolist()
    for t in outs:
        t.zero_()
    parents.fill_(-1)
    for b, (lp, tok) in enumerate(zip(lp_all, tok_all)):
        if chain:  # the worker's budget == L shortcut: the rank-0 token at every position
            tokens, depths, par = [row[0] for row in tok], list(range(1, L + 1)), list(range(-1, L))
        else:
            tokens, depths, par = _sglang_tree_one(lp, tok, budget, depth_bonus, log_budget, stop_margin)
        n = len(par)
        node_tokens[b, : n - 1] = torch.tensor(tokens, dtype=torch.int64)
        node_depths[b, : n - 1] = torch.tensor(depths, dtype=torch.int64)
        parents[b, :n] = torch.tensor(par, dtype=torch.int64)
        visibility[b, :n, :n] = ancestor_mask(par)
        tree_sizes[b] = n


@_fake("sglang_build_tree_")
def _sglang_build_tree_fake(topk_logprobs, topk_tokens, budget, depth_bonus, log_budget, stop_margin, chain,
                            node_tokens, node_depths, parents, visibility, tree_sizes):
    _check_sglang_tree_args(topk_logprobs, topk_tokens, budget, chain,
                            (node_tokens, node_depths, parents, visibility, tree_sizes))


def sglang_build_tree(
    topk_logprobs: torch.Tensor,
    topk_tokens: torch.Tensor,
    budget: int,
    *,
    depth_bonus: float = 0.2,
    stop_margin: float = 1.0,
    chain: bool = False,
    out: Optional[Sequence[torch.Tensor]] = None,
) -> SGLangTree:
    """Build every request's draft tree exactly as SGLang's DDTree worker does.

    Best-first over candidates keyed by (float64 score descending, rank tuple ascending), from
    the rank-0 token at depth 1 (score = its log-prob). Popping a candidate of rank tuple
    ``(r_1, ..., r_d)`` with score s:

    - skips it (it spawns nothing) if some r_i > 0 and ``s < lp[0, 0] - log_budget - stop_margin``
      (float64, subtracted in that order);
    - otherwise makes it the next node, then adds its next sibling ``(..., r_d + 1)`` with score
      ``s - lp[d-1, r_d] + lp[d-1, r_d + 1]`` (if r_d + 1 < K) and its first child
      ``(..., r_d, 0)`` with score ``s + lp[d, 0] + depth_bonus`` (if d < L),

    until ``budget`` nodes or no candidates are left; then the nodes are relabelled breadth-first
    (see :class:`SGLangTree`). With ``chain`` (needs budget == L) the tree is the chain of the
    rank-0 tokens, the worker's shortcut for that case. One CTA per request replays the heap;
    scores are compared exactly as the worker's Python heap compares them, ties included. NaN
    log-probs make that comparison inconsistent and the CUDA build may then differ from the
    worker's.

    Parameters
    ----------
    topk_logprobs : Tensor [B, L, K], float32, contiguous
        Per draft position (1 <= L <= 31), the top-K log-probs sorted descending
        (:func:`draft_topk` of the drafter's float32 logits).
    topk_tokens : Tensor [B, L, K], int64, contiguous
        Their token ids.
    budget : int
        Nodes besides the root, 1 to 1024; D = budget + 1.
    depth_bonus, stop_margin : float
        The worker's ``SGLANG_DDTREE_DEPTH_BONUS`` and early-stop margin.
    chain : bool
        Build the rank-0 chain instead (budget must equal L).
    out : sequence of 5 Tensors, optional
        Contiguous tensors with :class:`SGLangTree`'s shapes and dtypes to write into (e.g. views
        of persistent buffers); every element is written.

    Returns
    -------
    SGLangTree
        ``node_tokens [B, budget]`` int64, ``node_depths [B, budget]`` int64, ``parents [B, D]``
        int64, ``visibility [B, D, D]`` bool, ``tree_sizes [B]`` int64 (``out`` when given).
    """
    if _eager():
        _check_int("budget", budget, 1, MAX_TREE_BUDGET)
    if out is None:
        B, dev = topk_logprobs.shape[0], topk_logprobs.device
        D = budget + 1
        new = lambda *shape, dtype=torch.int64: torch.empty(shape, dtype=dtype, device=dev)
        out = (new(B, budget), new(B, budget), new(B, D), new(B, D, D, dtype=torch.bool), new(B))
    if _eager():
        _check_sglang_tree_args(topk_logprobs, topk_tokens, budget, chain, out)
    _cuda_kernels_for(topk_logprobs)
    torch.ops.kdtree.sglang_build_tree_(
        topk_logprobs, topk_tokens, budget, depth_bonus, math.log(max(budget, 1)), stop_margin, chain, *out
    )
    return SGLangTree(*out)


class RetrieveAccept(NamedTuple):
    """Greedy acceptance on EAGLE's retrieve arrays (see :func:`accept_retrieve`).

    Attributes
    ----------
    accepted : Tensor [B, max_depth + 1], int32
        Accepted nodes (request-local indices), root first, -1 after.
    accept_len : Tensor [B], int32
        Accepted nodes including the root (>= 1).
    bonus : Tensor [B], int64
        The target's token at the last accepted node.
    accepted_tokens : Tensor [B, D], int64
        The target's token at each accepted node, then ``bonus`` repeated.
    commit_order : Tensor [B * D], int64
        A permutation of the flat slots ``b * D + i``: first every request's accepted nodes in
        acceptance order (``sum(accept_len)`` entries), then every other slot ascending.
    """

    accepted: torch.Tensor
    accept_len: torch.Tensor
    bonus: torch.Tensor
    accepted_tokens: torch.Tensor
    commit_order: torch.Tensor


def _check_accept_retrieve_args(next_token, next_sibling, candidates, target_tokens, max_depth):
    _check(next_token.dim() == 2, lambda: f"kdtree: next_token must be [B, D], got {tuple(next_token.shape)}")
    for name, t in (("next_token", next_token), ("next_sibling", next_sibling), ("candidates", candidates),
                    ("target_tokens", target_tokens)):
        _check_tree_tensor(t, name, next_token, torch.int64)
    _check(1 <= next_token.shape[1] <= 4 * _MAX_STAGED_NODES,
                 lambda: f"kdtree: next_token must have 1 to {4 * _MAX_STAGED_NODES} nodes (dim 1), got {next_token.shape[1]}")
    _check_int("max_depth", max_depth, 0, _MAX_STAGED_NODES - 1)


@_define(
    "accept_retrieve(Tensor next_token, Tensor next_sibling, Tensor candidates, Tensor target_tokens, int max_depth) "
    "-> (Tensor, Tensor, Tensor, Tensor, Tensor)"
)
def _accept_retrieve_cpu(next_token, next_sibling, candidates, target_tokens, max_depth):
    _check_accept_retrieve_args(next_token, next_sibling, candidates, target_tokens, max_depth)
    B, D = next_token.shape
    nxt, sib, cand, tgt = (t.tolist() for t in (next_token, next_sibling, candidates, target_tokens))
    accepted = torch.full((B, max_depth + 1), -1, dtype=torch.int32)
    accept_len = torch.zeros(B, dtype=torch.int32)
    bonus = torch.zeros(B, dtype=torch.int64)
    accepted_tokens = torch.zeros(B, D, dtype=torch.int64)
    kept, rest = [], []
    for b in range(B):
        path = [0]
        while len(path) <= max_depth:
            want, child = tgt[b][path[-1]], nxt[b][path[-1]]
            while 0 <= child < D and cand[b][child] != want:
                child = sib[b][child]
            if not 0 <= child < D:  # -1, or an index past the tree: no child carries `want`
                break
            path.append(child)
        accepted[b, : len(path)] = torch.tensor(path, dtype=torch.int32)
        accept_len[b] = len(path)
        bonus[b] = tgt[b][path[-1]]
        accepted_tokens[b] = bonus[b]
        accepted_tokens[b, : len(path)] = torch.tensor([tgt[b][i] for i in path])
        kept += [b * D + i for i in path]
        on_path = set(path)
        rest += [b * D + i for i in range(D) if i not in on_path]
    dev = next_token.device
    order = torch.tensor(kept + rest, dtype=torch.int64)
    return tuple(t.to(dev) for t in (accepted, accept_len, bonus, accepted_tokens, order))


@_fake("accept_retrieve")
def _accept_retrieve_fake(next_token, next_sibling, candidates, target_tokens, max_depth):
    _check_accept_retrieve_args(next_token, next_sibling, candidates, target_tokens, max_depth)
    B, D = next_token.shape
    new = next_token.new_empty
    return (new((B, max_depth + 1), dtype=torch.int32), new((B,), dtype=torch.int32), new((B,), dtype=torch.int64),
            new((B, D), dtype=torch.int64), new((B * D,), dtype=torch.int64))


def accept_retrieve(
    next_token: torch.Tensor,
    next_sibling: torch.Tensor,
    candidates: torch.Tensor,
    target_tokens: torch.Tensor,
    max_depth: int,
) -> RetrieveAccept:
    """Greedy tree acceptance on EAGLE's retrieve arrays, as SGLang's ``verify_tree_greedy``.

    From the root, up to ``max_depth`` times: walk the current node's children through
    ``next_token`` / ``next_sibling`` and move to the first whose candidate token equals the
    target's token at the current node; stop when none does (a child index outside [0, D) ends a
    sibling list like -1). The retrieve index is taken to be ``b * D + i`` (as DDTree builds it),
    so slots are flat node indices.

    Parameters
    ----------
    next_token, next_sibling : Tensor [B, D], int64, contiguous
        Each node's first child and next sibling (request-local), -1 for none.
    candidates : Tensor [B, D], int64, contiguous
        Each node's draft token (the root's is never compared).
    target_tokens : Tensor [B, D], int64, contiguous
        The target's greedy token at each node.
    max_depth : int
        Most moves (the width of SGLang's ``accept_index`` minus one).

    Returns
    -------
    RetrieveAccept
        ``accepted [B, max_depth + 1]`` int32, ``accept_len [B]`` int32, ``bonus [B]`` int64,
        ``accepted_tokens [B, D]`` int64, ``commit_order [B * D]`` int64.
    """
    if _eager():
        _check_accept_retrieve_args(next_token, next_sibling, candidates, target_tokens, max_depth)
    _cuda_kernels_for(next_token)
    return RetrieveAccept(*torch.ops.kdtree.accept_retrieve(next_token, next_sibling, candidates, target_tokens, max_depth))


# ---- kv movement ----


def _row_bytes(kv: torch.Tensor) -> int:
    return math.prod(kv.shape[1:]) * kv.element_size()


def _check_move_args(kv_layers, src_slots, dst_slots):
    for name, t in (("src_slots", src_slots), ("dst_slots", dst_slots)):
        _check(t.dtype in (torch.int32, torch.int64), lambda: f"kdtree: {name} must be int32 or int64, got {t.dtype}")
        _check(t.dim() == 1, lambda: f"kdtree: {name} must have 1 dims, got shape {tuple(t.shape)}")
    _check(
        dst_slots.dtype == src_slots.dtype,
        lambda: f"kdtree: dst_slots must be {src_slots.dtype} like src_slots, got {dst_slots.dtype}",
    )
    _check(
        dst_slots.numel() == src_slots.numel(),
        lambda: f"kdtree: dst_slots must have {src_slots.numel()} entries like src_slots, got {dst_slots.numel()}",
    )
    if not kv_layers:
        return
    first = kv_layers[0]
    _check(first.dim() >= 1, lambda: "kdtree: kv_layers[0] must be [S, ...], got a scalar")
    for i, kv in enumerate(kv_layers):
        _check(
            kv.dim() >= 1 and kv.shape[0] == first.shape[0],
            lambda: f"kdtree: kv_layers[{i}] must have {first.shape[0]} slots like kv_layers[0], got shape {tuple(kv.shape)}",
        )
        _check(
            _row_bytes(kv) == _row_bytes(first),
            lambda: f"kdtree: kv_layers[{i}] must have rows of {_row_bytes(first)} bytes like kv_layers[0], got {_row_bytes(kv)}",
        )
        _check(kv.device == src_slots.device, lambda: f"kdtree: kv_layers[{i}] must be on {src_slots.device}, got {kv.device}")
        _check(kv[0].is_contiguous() if kv.shape[0] else True, lambda: f"kdtree: kv_layers[{i}] must have contiguous rows (only dim 0 may be strided), got strides {kv.stride()}")


def _check_move_slots(src, dst, slots: int, disjoint: bool) -> None:
    """The check-mode validation, on real data (the CUDA impl does the same on the device)."""
    live = (src >= 0) & (dst >= 0)
    bad = live & ((src >= slots) | (dst >= slots))
    if bad.any():
        i = int(bad.nonzero()[0])
        raise RuntimeError(
            f"kdtree: src_slots/dst_slots must lie in [0, {slots}) (negative marks padding), "
            f"got src_slots[{i}] = {int(src[i])}, dst_slots[{i}] = {int(dst[i])}"
        )
    d = dst[live]
    uniq, counts = torch.unique(d, return_counts=True)
    if (counts > 1).any():
        raise RuntimeError(f"kdtree: dst_slots must be distinct, but {int(uniq[counts > 1][0])} appears more than once")
    if disjoint:
        s = src[live]
        clash = torch.isin(s, d) & (s != d)
        if clash.any():
            raise RuntimeError(
                f"kdtree: disjoint=True needs src_slots and dst_slots to share no slot, but {int(s[clash][0])} is both"
            )


def _distinct_layers(kv_layers) -> list:
    """The buffers to move, each once: a tensor listed twice is one buffer (moving it twice
    would move moved rows); buffers that share memory in any other way are refused by name."""
    seen, spans, out = set(), [], []
    for i, kv in enumerate(kv_layers):
        key = (kv.data_ptr(), tuple(kv.shape), tuple(kv.stride()), kv.dtype)
        if key in seen:
            continue
        lo = kv.data_ptr()
        hi = lo + max(kv.shape[0] - 1, 0) * kv.stride(0) * kv.element_size() + _row_bytes(kv)
        for j, (a, b) in spans:
            if lo < b and a < hi and kv.shape[0] and kv_layers[j].shape[0]:
                raise RuntimeError(
                    f"kdtree: kv_layers[{i}] shares memory with kv_layers[{j}]; a buffer may appear twice only "
                    "as the identical tensor"
                )
        seen.add(key)
        spans.append((i, (lo, hi)))
        out.append(kv)
    return out


@_define("move_kv(Tensor(a!)[] kv_layers, Tensor src_slots, Tensor dst_slots, *, bool disjoint=False) -> ()")
def _move_kv_cpu(kv_layers, src_slots, dst_slots, disjoint=False):
    _check_move_args(kv_layers, src_slots, dst_slots)
    if not kv_layers:
        return
    _check_move_slots(src_slots, dst_slots, kv_layers[0].shape[0], disjoint)
    live = (src_slots >= 0) & (dst_slots >= 0)
    src, dst = src_slots[live], dst_slots[live]
    for kv in _distinct_layers(kv_layers):
        # Indexing with dtype views keeps fp8 (and other exotic dtypes) byte-exact.
        rows = kv.view(torch.uint8) if kv.element_size() == 1 else kv
        rows[dst] = rows[src]  # rows[src] is a gathered copy: every read precedes every write


@_fake("move_kv")
def _move_kv_fake(kv_layers, src_slots, dst_slots, disjoint=False):
    _check_move_args(kv_layers, src_slots, dst_slots)


def move_kv(
    kv_layers: Sequence[torch.Tensor], src_slots: torch.Tensor, dst_slots: torch.Tensor, *, disjoint: bool = False
) -> None:
    """Copy KV rows between slots in every layer: ``kv[dst[i]] = kv[src[i]]``.

    All reads happen before any write, so src and dst may overlap (e.g. compacting accepted
    tree nodes to the front of their verify window). One launch per 64 layers on the CUDA
    path (two when ``disjoint`` is false: gather into a scratch buffer, then scatter), no host
    sync, capturable in CUDA graphs.

    Parameters
    ----------
    kv_layers : list of Tensor [S, ...]
        The pool's per-layer buffers (e.g. SGLang's ``MLATokenToKVPool.kv_buffer``), modified in
        place. Any dtype (fp8 stored as uint8 too): rows are copied as bytes. All layers need the
        same slot count S and row size in bytes; each row must be contiguous (dim 0 may be
        strided).
    src_slots, dst_slots : Tensor [n], int32 or int64 (same dtype)
        Slot pairs. A pair with a negative slot in either tensor is padding and skipped, so
        fixed-size, padded pair lists work under CUDA graphs. Other slots must lie in [0, S)
        and non-padding dst slots must be distinct: the CPU reference checks both always, CUDA
        with ``KDTREE_CHECK=1`` (a host sync); unchecked, the CUDA kernel skips out-of-range
        pairs.
    disjoint : bool
        Promise that no slot is both a source and another pair's destination: copies in a
        single pass (half the memory traffic). Breaking the promise gives undefined row
        contents (validated in check mode).
    """
    if _eager():
        _check_move_args(list(kv_layers), src_slots, dst_slots)
    _cuda_kernels_for(src_slots)
    torch.ops.kdtree.move_kv(list(kv_layers), src_slots, dst_slots, disjoint=disjoint)

# KDTREE_VERIFY=validate|on: hook SGLang's verify attention (sglang_hook.py). Only when SGLang
# is importable, and a hook problem never fails this import.
if os.environ.get("KDTREE_VERIFY", "off").strip().lower() not in ("", "off"):
    try:
        import importlib.util

        if importlib.util.find_spec("sglang") is not None:
            import sglang_hook

            sglang_hook.maybe_install_from_env()
    except Exception as _e:  # noqa: BLE001
        import logging

        logging.getLogger("kdtree_ops").warning("kdtree_ops: SGLang verify hook not installed: %s", _e)
