"""llama.cpp's own C++ ``llama-server`` for bench_serve_peers, built once from the package registry's source into a
cache folder.

The source is the llama.cpp tree vendored in llama-cpp-python VERSION's source distribution (the commit its
changelog names, LLAMA_CPP_COMMIT; the same source benchmarks/peers/llama_build.py builds the Python bindings from):
``pip download --no-deps --no-binary :all: llama-cpp-python==VERSION``, extracted, and its ``vendor/llama.cpp``
configured with CMake (CMAKE_ARGS below) and built with ``cmake --build build --target llama-server``. The flags:
this CPU's own instructions (-DGGML_NATIVE=ON) without AMX_INT8 (-mno-amx-int8 in CMAKE_C_FLAGS/CMAKE_CXX_FLAGS; on
an Intel Xeon with AMX the native build's AMX path crashes on the first llama_decode, SIGSEGV, llama.cpp issue
#20824; on CPUs without AMX the flag changes nothing); static libraries (-DBUILD_SHARED_LIBS=OFF), so the binary
needs no libllama/libggml beside it; no curl or OpenSSL (models are local files), no web UI, tests or examples.

The binary lands in ``<cache>/llama-server-<version>-<key>/bin/llama-server`` with build.json (flags, commit,
compiler, CPU, build seconds) and build.log; the key hashes the version, the flags, the compiler, the machine and
the CPU's model name (a native build is for the CPU it was built on). The folder is written under a temporary name
and renamed into place, so an interrupted build leaves nothing that looks finished. Nothing of it runs in the test
suite: the build takes about 10 minutes on 2 cores.
Usage (builds if the cache has none, then prints build.json):
    python benchmarks/peers/llama_server_build.py
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from llama_build import (  # noqa: E402  (this folder on sys.path first, whichever way this module is imported)
    LLAMA_CPP_COMMIT,
    NO_AMX,
    VERSION,
    _compiler,
    cache_root,
    download_sdist,
    run_logged,
)

CMAKE_ARGS = [
    "-DGGML_NATIVE=ON",
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_TOOLS=ON",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    f"-DCMAKE_C_FLAGS={NO_AMX}",
    f"-DCMAKE_CXX_FLAGS={NO_AMX}",
]
TARGET = "llama-server"


def cpu_model() -> str:
    """/proc/cpuinfo's first ``model name`` (else platform.processor())."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def build_dir(root: Path | None = None) -> Path:
    """Where this version, these flags, this compiler, machine and CPU's build lives (built or not)."""
    key = json.dumps([VERSION, CMAKE_ARGS, _compiler(), platform.machine(), cpu_model()])
    return (root or cache_root()) / f"llama-server-{VERSION}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def ensure_built(root: Path | None = None, say=print) -> dict:
    """The build's record (build.json, with ``binary``: the llama-server executable's path), building it first if
    the cache has none. pip's, CMake's and the compiler's output goes to build.log beside it."""
    dest = build_dir(root)
    record = dest / "build.json"
    if record.is_file():
        return {**json.loads(record.read_text()), "binary": str(dest / "bin" / TARGET), "cached": True}
    dest.parent.mkdir(parents=True, exist_ok=True)
    work = dest.with_name(f".{dest.name}.partial-{os.getpid()}")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    jobs = os.cpu_count() or 1
    t0 = time.perf_counter()
    say(
        f"building llama.cpp {LLAMA_CPP_COMMIT}'s {TARGET} (from llama-cpp-python {VERSION}'s source) into {dest} "
        f"(once; about 10 minutes on 2 cores)"
    )
    with (work / "build.log").open("w") as log:
        sdist = download_sdist(work / "src", log)
        with tarfile.open(sdist) as tar:
            tar.extractall(work / "src", filter="data")
        (tree,) = (p.parent for p in (work / "src").glob("*/vendor/llama.cpp/CMakeLists.txt"))
        build = tree / "build"
        run_logged(["cmake", "-S", str(tree), "-B", str(build), *CMAKE_ARGS], log)
        run_logged(["cmake", "--build", str(build), "--target", TARGET, "-j", str(jobs)], log)
        (binary,) = build.glob(f"bin/{TARGET}")
        (work / "bin").mkdir()
        shutil.copy2(binary, work / "bin" / TARGET)
        ldd = subprocess.run(["ldd", str(work / "bin" / TARGET)], capture_output=True, text=True).stdout
        log.write(f"$ ldd {TARGET}\n{ldd}")
        version = subprocess.run(
            [str(work / "bin" / TARGET), "--version"], capture_output=True, text=True
        )  # llama.cpp prints its version to stderr
        info = {
            "product": TARGET,
            "source": f"llama-cpp-python=={VERSION} sdist, vendor/llama.cpp",
            "llama_cpp_commit": LLAMA_CPP_COMMIT,
            "cmake_args": CMAKE_ARGS,
            "build_jobs": jobs,
            "compiler": _compiler(),
            "cmake": subprocess.run(["cmake", "--version"], capture_output=True, text=True).stdout.splitlines()[0],
            "machine": platform.machine(),
            "cpu": cpu_model(),
            "sdist_sha256": hashlib.sha256(sdist.read_bytes()).hexdigest(),
            "version": (version.stdout + version.stderr).strip(),
            "shared_libs": sorted(line.split()[0] for line in ldd.splitlines() if "=>" in line),
            "build_s": round(time.perf_counter() - t0),
        }
    (work / "build.json").write_text(json.dumps(info, indent=1) + "\n")
    shutil.rmtree(work / "src")
    os.replace(work, dest)
    say(f"built in {info['build_s']} s: {dest / 'bin' / TARGET}")
    return {**info, "binary": str(dest / "bin" / TARGET), "cached": False}


if __name__ == "__main__":
    print(json.dumps(ensure_built(), indent=1))
