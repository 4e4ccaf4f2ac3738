"""What `gpu_check.py` needs beyond the GPU image, in two bundles that each fit one device call, and their install.

    python benchmarks/gpu_wheels.py                        # here, with network: builds benchmarks/gpu_wheels/{a,b}
    python benchmarks/gpu_wheels.py --python-version 3.13  # for an image with another CPython

The GPU machine has no network, and a call carries 64 MiB at most, the working tree (about 2.3 MiB) included. Its
image has torch 2.11.0+cu130, transformers 5.17, accelerate, peft, pyarrow, pandas and the rest of KINDS.md's list,
under CPython 3.12; it lacks what this script downloads (`pip download --no-deps`, Linux x86-64 wheels for that
Python):
- bundle A (`benchmarks/gpu_wheels/a`): the transformers, TRL and datasets this repository tests with (the versions
  installed here), dill and multiprocess for datasets, gguf (to read the bundled SmolLM2, whose own 93 MB wheel fits
  no call), FlashAttention 4 (`flash-attn-4` with `nvidia-cutlass-dsl`, its libs-base and libs-core wheels,
  `quack-kernels`, `apache-tvm-ffi`, `torch-c-dlpack-ext`), `zstandard` (to unpack bundle B where the image has no
  `zstd`), a `requirements.txt` pinning each, and the demo conversations tokenized (`token_documents.py`: 4 MB instead
  of the demo extra's tokenizer packages);
- bundle B (`benchmarks/gpu_wheels/b`): CuTe-DSL's CUDA 13 libraries (`nvidia-cutlass-dsl-libs-cu13`, a 92 MB wheel
  of 237 MB of files, nearly all of it two shared libraries), unpacked, pruned of what FlashAttention 4 never loads
  (stubs for aarch64 and QNX, a static library, a C header) and packed as tar + `zstd --ultra -22 --long=30`
  (about 55 MiB; xz -9e gave 59 MiB). Compressing takes about 10 minutes on 2 cores; it is redone only when the wheel
  changes.
nvidia-cutlass-dsl requires the CUDA 12 libraries too (another 92 MB): they are left out, as the image's driver runs
CUDA 13 and CuTe-DSL loads the newest flavour the driver supports. That is why the install passes `--no-deps`; the
build checks instead that every other requirement of every wheel is in the bundle or in the image.

On the GPU machine, `gpu_check.py --wheels DIR` calls [`install`]: pip installs a bundle's `requirements.txt` from its
folder (`--no-index --no-deps --find-links DIR`) into the running Python, and unpacks a bundle's archives into its
site-packages. The two calls and their carry lists are in `gpu_check.py`'s docstring.
"""

import argparse
import glob
import hashlib
import importlib.metadata
import io
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import zipfile


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FOLDER = os.path.join(ROOT, "benchmarks", "gpu_wheels")
CALL_LIMIT = 64 * 2**20  # what one device call carries, working tree included
# Packages of bundle A, pinned; None: the version installed here (the one this repository's tests run).
BUNDLE_A = {
    "transformers": None, "trl": None, "datasets": None, "dill": None, "multiprocess": None, "gguf": None,
    "flash-attn-4": "4.0.0b36", "nvidia-cutlass-dsl": "4.8.1", "nvidia-cutlass-dsl-libs-base": "4.8.1",
    "nvidia-cutlass-dsl-libs-core": "4.8.1", "quack-kernels": "0.6.5", "apache-tvm-ffi": "0.1.15.post2",
    "torch-c-dlpack-ext": "0.1.5", "zstandard": "0.25.0",
}
LIBS = ("nvidia-cutlass-dsl-libs-cu13", "4.8.1")  # bundle B
# Files of the libs wheel that FlashAttention 4 never loads on Linux x86-64 (path prefixes and suffixes).
PRUNED_PREFIXES = ("nvidia_cutlass_dsl/cu13/lib/stubs/", "nvidia_cutlass_dsl/cu13/include/")
PRUNED_SUFFIXES = (".a",)
# Requirements of bundle A's wheels that the GPU image meets (KINDS.md, "Python packages already there"), and those
# met otherwise.
IMAGE_HAS = {
    "accelerate", "cuda-bindings", "einops", "filelock", "fsspec", "huggingface-hub", "jinja2", "numpy", "packaging",
    "pandas", "protobuf", "psutil", "pyarrow", "pyyaml", "regex", "requests", "safetensors", "tokenizers", "torch",
    "tqdm", "typer", "typing-extensions", "xxhash",
}
MET_OTHERWISE = {
    "nvidia-cutlass-dsl-libs-cu12": "left out: the CUDA 13 flavour (bundle B) serves the image's driver",
    "nvidia-cutlass-dsl-libs-cu13": "bundle B",
}
CONVERSATIONS = "conversations.npz"
ZSTD_WINDOW_LOG = 30


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python-version", default="3.12", help="CPython of the GPU image (default 3.12)")
    parser.add_argument("--folder", default=FOLDER, help="where bundles a/ and b/ and the download cache go")
    args = parser.parse_args()
    cache = os.path.join(args.folder, "cache", f"cp{args.python_version.replace('.', '')}")
    pins = {name: version or importlib.metadata.version(name) for name, version in BUNDLE_A.items()}
    download([*(f"{name}=={version}" for name, version in pins.items()), "==".join(LIBS)], cache,
             args.python_version)
    wheels = {name: wheel_path(cache, name, version) for name, version in pins.items()}
    check_requirements(wheels, args.python_version)
    bundle_a = os.path.join(args.folder, "a")
    build_bundle_a(wheels, pins, bundle_a)
    bundle_b = os.path.join(args.folder, "b")
    build_bundle_b(wheel_path(cache, *LIBS), bundle_b)
    return report_sizes({"a": bundle_a, "b": bundle_b})


def download(requirements: list[str], cache: str, python_version: str) -> None:
    platforms = [f"manylinux_2_{minor}_x86_64" for minor in (35, 34, 31, 28, 27, 24, 17)] + ["manylinux2014_x86_64"]
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version",
               python_version, "--implementation", "cp", *(f"--platform={p}" for p in platforms), "-d", cache,
               "--disable-pip-version-check", "-q", *requirements]
    subprocess.run(command, check=True)


def wheel_path(cache: str, name: str, version: str) -> str:
    stem = name.replace("-", "_")
    found = [path for path in glob.glob(os.path.join(cache, "*.whl"))
             if os.path.basename(path).lower().startswith(f"{stem}-{version}-".lower())]
    if len(found) != 1:
        raise FileNotFoundError(f"expected one wheel of {name}=={version} in {cache}, found {found}")
    return found[0]


def check_requirements(wheels: dict[str, str], python_version: str) -> None:
    """Every requirement of every bundle-A wheel (markers evaluated for the image's Python on Linux, no extras) is
    in bundle A, in the image (`IMAGE_HAS`) or in `MET_OTHERWISE`; else stop, naming the package to add."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    environment = {"python_version": python_version, "python_full_version": f"{python_version}.0",
                   "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
                   "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}
    bundled = {canonicalize_name(name) for name in wheels}
    missing = []
    for name, path in wheels.items():
        for requirement in map(Requirement, wheel_requirements(path)):
            if requirement.marker is not None and not requirement.marker.evaluate(environment):
                continue
            needed = canonicalize_name(requirement.name)
            if needed not in bundled | IMAGE_HAS | set(MET_OTHERWISE):
                missing.append(f"{name} needs {requirement}")
    if missing:
        raise SystemExit("gpu_wheels: requirements neither bundled nor in the GPU image: " + "; ".join(missing) +
                         ". Add each to BUNDLE_A (or, if the image has it, to IMAGE_HAS).")


def wheel_requirements(path: str) -> list[str]:
    with zipfile.ZipFile(path) as wheel:
        metadata = next(item for item in wheel.namelist() if item.endswith(".dist-info/METADATA"))
        lines = wheel.read(metadata).decode().splitlines()
    return [line.split(":", 1)[1].strip() for line in lines if line.startswith("Requires-Dist:")]


def build_bundle_a(wheels: dict[str, str], pins: dict[str, str], folder: str) -> None:
    """Bundle A: the wheels, `requirements.txt` pinning each, and the tokenized demo conversations."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import token_documents

    from llm_packing.cli.documents import load_demo_documents

    shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(folder)
    for path in wheels.values():
        shutil.copy2(path, folder)
    with open(os.path.join(folder, "requirements.txt"), "w", encoding="utf-8") as file:
        file.writelines(f"{name}=={version}\n" for name, version in pins.items())
    token_documents.save_documents(load_demo_documents(), os.path.join(folder, CONVERSATIONS))


def build_bundle_b(wheel: str, folder: str) -> None:
    """Bundle B: the libs wheel's files, pruned, as one tar.zst (with its dist-info, so that pip and
    importlib.metadata see it installed); kept if it was built from the same wheel."""
    archive = os.path.join(folder, os.path.basename(wheel).split("-cp")[0] + ".tar.zst")
    digest = hashlib.sha256(open(wheel, "rb").read()).hexdigest()
    stamp = os.path.join(folder, "bundle.json")
    if os.path.exists(archive) and os.path.exists(stamp):
        with open(stamp, encoding="utf-8") as file:
            if json.load(file).get("wheel_sha256") == digest:
                print(f"gpu_wheels: {os.path.relpath(archive, ROOT)} is up to date")
                return
    shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(folder)
    kept, pruned = 0, 0
    with tempfile.TemporaryDirectory() as directory:
        tar_path = os.path.join(directory, "libs.tar")
        with zipfile.ZipFile(wheel) as source, tarfile.open(tar_path, "w", format=tarfile.PAX_FORMAT) as tar:
            for item in sorted(source.infolist(), key=lambda item: item.filename):
                if item.is_dir():
                    continue
                data = source.read(item)
                if pruned_file(item.filename):
                    pruned += len(data)
                    continue
                if item.filename.endswith(".dist-info/RECORD"):
                    data = "".join(line for line in data.decode().splitlines(keepends=True)
                                   if not pruned_file(line.split(",", 1)[0])).encode()
                info = tarfile.TarInfo(item.filename)
                info.size, info.mode = len(data), 0o755 if item.filename.endswith(".so") else 0o644
                tar.addfile(info, io.BytesIO(data))
                kept += len(data)
        print(f"gpu_wheels: compressing {kept / 2**20:,.1f} MiB ({pruned / 2**20:,.2f} MiB pruned) with zstd -22 "
              "(about 10 minutes on 2 cores)", flush=True)
        subprocess.run(["zstd", "--ultra", "-22", f"--long={ZSTD_WINDOW_LOG}", "-T0", "-q", "-f", tar_path, "-o",
                        archive], check=True)
    with open(stamp, "w", encoding="utf-8") as file:
        json.dump({"wheel": os.path.basename(wheel), "wheel_sha256": digest, "unpacked_bytes": kept,
                   "pruned_bytes": pruned, "archive": os.path.basename(archive)}, file, indent=1)


def pruned_file(name: str) -> bool:
    return name.startswith(PRUNED_PREFIXES) or name.endswith(PRUNED_SUFFIXES)


def report_sizes(bundles: dict[str, str]) -> int:
    """Each bundle's size and what its call carries with the working tree; 1 if a call would exceed 64 MiB."""
    tree = working_tree_bytes()
    print(f"working tree that travels with every call: {tree / 2**20:.2f} MiB")
    status = 0
    for name, folder in bundles.items():
        size = sum(os.path.getsize(path) for path in glob.glob(os.path.join(folder, "*")))
        verdict = "fits" if size + tree <= CALL_LIMIT else "OVER the 64 MiB a call carries"
        status |= size + tree > CALL_LIMIT
        print(f"bundle {name} ({os.path.relpath(folder, ROOT)}): {size:,} bytes = {size / 2**20:.2f} MiB; "
              f"with the tree {(size + tree) / 2**20:.2f} MiB: {verdict}")
        for path in sorted(glob.glob(os.path.join(folder, "*"))):
            print(f"  {os.path.getsize(path) / 2**20:8.2f} MiB  {os.path.basename(path)}")
    return int(status)


def working_tree_bytes() -> int:
    """Bytes of what a call sends: tracked files and untracked ones git does not ignore."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=True).stdout.split(b"\0")
    paths = [os.path.join(ROOT, name.decode()) for name in listed if name]
    return sum(os.path.getsize(path) for path in paths if os.path.isfile(path))


# ---------------------------------------------------------------- on the GPU machine

def install_plan(folder: str, site: str | None = None) -> list[tuple[str, list[str] | str, str | None]]:
    """What [`install`] does with `folder`: ("pip", the pip command, None) for its `requirements.txt`, and
    ("unpack", archive, site-packages) for each `*.tar.zst`."""
    site = site or sysconfig.get_paths()["purelib"]
    plan = []
    requirements = os.path.join(folder, "requirements.txt")
    if os.path.exists(requirements):
        plan.append(("pip", [sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--no-compile",
                             "--disable-pip-version-check", "-q", "--find-links", folder, "-r", requirements], None))
    plan += [("unpack", archive, site) for archive in sorted(glob.glob(os.path.join(folder, "*.tar.zst")))]
    if not plan:
        raise FileNotFoundError(f"--wheels {folder!r} holds neither requirements.txt nor a *.tar.zst bundle; build "
                                "the bundles with `python benchmarks/gpu_wheels.py` and carry benchmarks/gpu_wheels/a "
                                "or /b")
    return plan


def install(folder: str) -> None:
    """Install a bundle into the running Python (see [`install_plan`])."""
    for kind, what, site in install_plan(folder):
        print(f"gpu_wheels: {kind} {what if kind == 'unpack' else ' '.join(what)}", flush=True)
        if kind == "pip":
            subprocess.run(what, check=True)
        else:
            unpack(what, site)


def unpack(archive: str, site: str) -> None:
    """Extract a tar.zst bundle into `site`: through the `zstd` program where there is one, else `zstandard`."""
    if shutil.which("zstd"):
        process = subprocess.Popen(["zstd", "-d", "-c", f"--long={ZSTD_WINDOW_LOG}", archive], stdout=subprocess.PIPE)
        with tarfile.open(fileobj=process.stdout, mode="r|") as tar:
            tar.extractall(site, filter="data")
        if process.wait():
            raise RuntimeError(f"zstd -d {archive} failed with exit code {process.returncode}")
        return
    import zstandard

    with open(archive, "rb") as file:
        reader = zstandard.ZstdDecompressor(max_window_size=2**ZSTD_WINDOW_LOG).stream_reader(file)
        with tarfile.open(fileobj=reader, mode="r|") as tar:
            tar.extractall(site, filter="data")


if __name__ == "__main__":
    sys.exit(main())
