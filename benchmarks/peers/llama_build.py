"""llama.cpp for bench_peers, built once from the package registry's source into a cache folder.

llama-cpp-python (its bindings, with llama.cpp vendored at the commit its changelog names) is downloaded as a source
distribution, built into a wheel by pip with the CMake flags below, and installed with its one pure-Python import
dependency (diskcache) into ``<cache>/llama-cpp-python-<version>-<key>/site``; the key hashes the version, the flags,
the compiler and the machine, so another build never reuses this one. The flags build for this CPU's own
instructions (-DGGML_NATIVE=ON) but without AMX_INT8 (-mno-amx-int8 in CMAKE_C_FLAGS/CMAKE_CXX_FLAGS): on an Intel
Xeon with AMX the native build's AMX path crashes on the first llama_decode (SIGSEGV, llama.cpp issue #20824); on
CPUs without AMX the flag changes nothing. The folder is written under a temporary name and renamed into place, so
an interrupted build leaves nothing that looks finished. benchmarks/peers/llama_server_build.py builds llama.cpp's own
C++ llama-server from the same source the same way. Nothing of it runs in the test suite: a CPU build takes about 4
minutes on 2 cores.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

VERSION = "0.3.36"
LLAMA_CPP_COMMIT = (
    "0c1e57098"  # llama-cpp-python 0.3.36's CHANGELOG: "update llama.cpp to ggml-org/llama.cpp@0c1e57098"
)
# This CPU's own instructions (AVX-512 here), as a user building llama.cpp for their machine gets by default;
# the multimodal library left out (not used, a third of the build). AMX_INT8 off: on an Intel Xeon with AMX the
# native build's AMX path (ggml_backend_amx_mul_mat) crashes on the first llama_decode (SIGSEGV; llama.cpp issue
# #20824); with it off it runs, and on CPUs without AMX the flag changes nothing. An explicit -mno-* wins over
# -march=native in GCC and Clang whatever their order on the command line.
NO_AMX = "-mno-amx-int8"
CMAKE_ARGS = (
    f"-DGGML_NATIVE=ON -DLLAVA_BUILD=OFF -DCMAKE_BUILD_TYPE=Release -DCMAKE_C_FLAGS={NO_AMX} -DCMAKE_CXX_FLAGS={NO_AMX}"
)
DISKCACHE = "5.6.3"  # imported by llama_cpp/__init__ (llama_cache); numpy comes from the running environment


def cache_root() -> Path:
    """``$KVGRAFT_PEER_CACHE``, else ``~/.cache/kvgraft/peers``."""
    return Path(os.environ.get("KVGRAFT_PEER_CACHE") or Path.home() / ".cache" / "kvgraft" / "peers")


def _compiler() -> str:
    try:
        return subprocess.run(["c++", "--version"], capture_output=True, text=True).stdout.splitlines()[0]
    except (OSError, IndexError):
        return "unknown"


def run_logged(cmd: list[str], log, cwd: Path | None = None, env: dict | None = None) -> None:
    """Run ``cmd`` with its output appended to the open file ``log``; SystemExit naming the log if it fails."""
    log.write(f"$ {' '.join(cmd)}\n")
    log.flush()
    rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=cwd, env=env).returncode
    if rc:
        raise SystemExit(f"building llama.cpp failed ({' '.join(cmd)[:160]} exited {rc}); see {log.name}")


def download_sdist(folder: Path, log) -> Path:
    """llama-cpp-python VERSION's source distribution from the package registry, into ``folder``."""
    run_logged(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", f"llama-cpp-python=={VERSION}"]
        + ["-d", str(folder)],
        log,
    )
    (sdist,) = folder.glob("*.tar.gz")
    return sdist


def build_dir(root: Path | None = None) -> Path:
    """Where this version, these flags, this compiler and machine's build lives (built or not)."""
    key = json.dumps([VERSION, CMAKE_ARGS, _compiler(), platform.machine(), sys.version_info[:2]])
    return (root or cache_root()) / f"llama-cpp-python-{VERSION}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def ensure_built(root: Path | None = None, say=print) -> dict:
    """The build's record (build.json, with ``site``: the folder to put on sys.path), building it first if the
    cache has none. Pip's output goes to build.log beside it."""
    dest = build_dir(root)
    record = dest / "build.json"
    if record.is_file():
        return {**json.loads(record.read_text()), "site": str(dest / "site"), "cached": True}
    dest.parent.mkdir(parents=True, exist_ok=True)
    work = dest.with_name(f".{dest.name}.partial-{os.getpid()}")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    log = (work / "build.log").open("w")
    env = {**os.environ, "CMAKE_ARGS": CMAKE_ARGS, "CMAKE_BUILD_PARALLEL_LEVEL": str(os.cpu_count() or 1)}

    def pip(*args: str) -> None:
        run_logged([sys.executable, "-m", "pip", *args], log, env=env)

    t0 = time.perf_counter()
    say(
        f"building llama-cpp-python {VERSION} (llama.cpp {LLAMA_CPP_COMMIT}) from source into {dest} "
        f"(once; about 4 minutes on 2 cores)"
    )
    sdist = download_sdist(work / "src", log)
    pip("wheel", "--no-deps", str(sdist), "-w", str(work / "wheel"))
    (wheel,) = (work / "wheel").glob("*.whl")
    pip("install", "--no-deps", "--target", str(work / "site"), str(wheel), f"diskcache=={DISKCACHE}")
    info = {
        "package": f"llama-cpp-python=={VERSION}",
        "llama_cpp_commit": LLAMA_CPP_COMMIT,
        "cmake_args": CMAKE_ARGS,
        "compiler": _compiler(),
        "machine": platform.machine(),
        "sdist_sha256": hashlib.sha256(sdist.read_bytes()).hexdigest(),
        "build_s": round(time.perf_counter() - t0),
    }
    (work / "build.json").write_text(json.dumps(info, indent=1) + "\n")
    log.close()
    shutil.rmtree(work / "src")
    os.replace(work, dest)
    say(f"built in {info['build_s']} s")
    return {**info, "site": str(dest / "site"), "cached": False}
