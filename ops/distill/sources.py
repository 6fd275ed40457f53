"""Offline text sources for distillation prompts (Debian packages; none of it is evaluation data).

Each loader returns plain-text units (passages, sentences, definitions) and never touches the network:
    python3-doc          /usr/share/doc/python3.11/html/_sources/**/*.rst.txt   (Python's documentation)
    debian-reference-en  /usr/share/debian-reference/debian-reference.en.txt.gz
    manpages (+ others)  /usr/share/man/man{1,5,7,8}/*.gz rendered with `man -l`
    dict-gcide           /usr/share/dictd/gcide.dict.dz                         (dictionary entries)
    wordnet-base         /usr/share/wordnet/data.{noun,verb,adj}                (words + glosses)
    fortunes, fortunes-de  /usr/share/games/fortunes/{*,de/*}                   (English / German quotes)
"""

from __future__ import annotations

import gzip
import os
import random
import re
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

PY_DOCS = Path("/usr/share/doc/python3.11/html/_sources")
DEBIAN_REF = Path("/usr/share/debian-reference/debian-reference.en.txt.gz")
MAN_ROOT = Path("/usr/share/man")
GCIDE = Path("/usr/share/dictd/gcide.dict.dz")
WORDNET = Path("/usr/share/wordnet")
FORTUNES = Path("/usr/share/games/fortunes")

PACKAGES = ("python3-doc", "debian-reference-en", "manpages", "dict-gcide", "wordnet-base", "fortunes", "fortunes-de")


def package_versions() -> dict[str, str]:
    out = {}
    for p in PACKAGES:
        r = subprocess.run(["dpkg-query", "-W", "-f=${Version}", p], capture_output=True, text=True)
        out[p] = r.stdout.strip() if r.returncode == 0 else "not installed"
    return out


def _clean_rst(text: str) -> str:
    text = re.sub(r":[a-zA-Z:]+:`~?([^`<]*?)(?:\s*<[^>]*>)?`", r"\1", text)  # :func:`x` -> x
    text = re.sub(r"`([^`<]+?)\s*<[^>]+>`_+", r"\1", text)  # `label <url>`_ -> label
    text = re.sub(r"``([^`]+)``", r"\1", text)
    text = re.sub(r"\*\*([^*]+)\*\*", r"\1", text)
    text = re.sub(r"\[#[^\]]*\]_", "", text)
    return text


def _paragraphs(text: str) -> list[str]:
    """Blank-line separated blocks; prose is reflowed onto one line, code-like blocks keep their lines."""
    paras = []
    for block in re.split(r"\n\s*\n", text):
        lines = [ln.rstrip() for ln in block.splitlines() if ln.strip()]
        lines = [ln for ln in lines if not re.fullmatch(r"\s*[=\-~^*#+\"'`.]{3,}\s*", ln)]  # rst rules
        if not lines:
            continue
        if lines[0].lstrip().startswith(".. ") and len(lines) <= 3:  # bare directive
            continue
        indent = min(len(ln) - len(ln.lstrip()) for ln in lines)
        lines = [ln[indent:] for ln in lines]
        code = any(ln.startswith((">>>", "$ ", "# ", "    ")) for ln in lines) or lines[0].endswith("::")
        paras.append("\n".join(lines) if code else " ".join(ln.strip() for ln in lines))
    return paras


def python_doc_sections() -> list[tuple[str, list[str]]]:
    """(document title, paragraphs) for every Python documentation page."""
    docs = []
    for f in sorted(PY_DOCS.rglob("*.rst.txt")):
        if "whatsnew" in f.parts or f.name in ("license.rst.txt", "copyright.rst.txt"):
            continue
        text = _clean_rst(f.read_text(errors="replace"))
        paras = [p for p in _paragraphs(text) if not p.lstrip().startswith((".. ", ":"))]
        if paras:
            title = f.name.removesuffix(".rst.txt").replace("_", " ")
            docs.append((title, paras))
    return docs


def debian_reference_sections() -> list[tuple[str, list[str]]]:
    text = gzip.open(DEBIAN_REF, "rt", errors="replace").read()
    docs: list[tuple[str, list[str]]] = []
    # Chapters/sections start with numbered headings like "1.2.3. Title".
    start = text.find("\n1.1. Console basics")
    body = text[start:] if start >= 0 else text  # skip the table of contents
    body = body.replace("\u00a0", " ")
    parts = re.split(r"\n(?=\d+(?:\.\d+)+\. \S)", body)
    for part in parts:
        paras = [p for p in _paragraphs(part) if "|" not in p and "+---" not in p]
        if len(paras) >= 2:
            docs.append((paras[0].splitlines()[0][:80], paras[1:]))
    return docs


def _render_man(path: Path) -> tuple[str, str]:
    env = dict(os.environ, MANWIDTH="100")
    r = subprocess.run(["man", "-l", "-E", "ascii", str(path)], capture_output=True, text=True, env=env, timeout=20)
    text = re.sub(r".\x08", "", r.stdout)  # strip overstrike (col -b)
    name = path.name.split(".")[0]
    return name, text


MAN_PACKAGES = ("manpages", "coreutils", "util-linux", "findutils", "grep", "sed", "tar", "bash", "procps",
                "openssh-client", "git", "man-db", "apt", "dpkg", "systemd")


def _package_man_files(packages: tuple[str, ...]) -> list[Path]:
    files: list[Path] = []
    for p in packages:
        r = subprocess.run(["dpkg", "-L", p], capture_output=True, text=True)
        for line in r.stdout.splitlines():
            if re.match(r"^/usr/share/man/man[1-8]/.*\.gz$", line) and Path(line).is_file():
                files.append(Path(line))
    return sorted(set(files))


def man_pages(limit: int, rng: random.Random) -> list[tuple[str, list[str]]]:
    """Rendered English man pages of a fixed list of Debian packages (MAN_PACKAGES; those installed)."""
    files = _package_man_files(MAN_PACKAGES)
    rng.shuffle(files)
    files = files[:limit]
    with ThreadPoolExecutor(max_workers=4) as ex:
        rendered = list(ex.map(_render_man, files))
    docs = []
    for name, text in rendered:
        lines = text.splitlines()[1:-1]  # drop header/footer lines
        paras = [re.sub(r"^[A-Z][A-Z /-]+\n", "", p) for p in _paragraphs("\n".join(lines))]  # section names
        paras = [re.sub(r"-\n\s*", "-", p) for p in paras]
        paras = [re.sub(r"\s+", " ", p).strip() for p in paras]
        paras = [p for p in paras if len(p) > 40]
        if len(paras) >= 3:
            docs.append((name, paras))
    return docs


def wordnet_entries() -> list[tuple[str, str, str]]:
    """(pos, words joined by ', ', gloss) per synset."""
    out = []
    for pos, fname in (("noun", "data.noun"), ("verb", "data.verb"), ("adjective", "data.adj")):
        for line in open(WORDNET / fname, errors="replace"):
            if line.startswith("  ") or "|" not in line:
                continue
            head, gloss = line.split("|", 1)
            f = head.split()
            n = int(f[3], 16)
            words = [f[4 + 2 * i].replace("_", " ") for i in range(n)]
            out.append((pos, ", ".join(words), gloss.strip()))
    return out


def gcide_entries(limit: int, rng: random.Random) -> list[tuple[str, str]]:
    """(headword, definition text) pairs from the GNU Collaborative International Dictionary."""
    text = gzip.open(GCIDE, "rt", errors="replace").read()
    entries = re.split(r"\n\n(?=\S)", text)
    rng.shuffle(entries)
    out = []
    for e in entries:
        lines = e.strip("\n").splitlines()
        if len(lines) < 2 or lines[0].startswith(("00-", " ")):
            continue
        head = lines[0].split("\\")[0].strip()
        body = re.sub(r"\s+", " ", " ".join(ln.strip() for ln in lines)).strip()
        body = re.sub(r"\\[^\\]*\\,?", "", body)  # pronunciation, e.g. \Fre"quent\,
        body = re.sub(r"\[(?:WordNet|Webster|1913|PJC)[^\]]*\]", "", body)
        if 80 < len(body) < 1500 and re.fullmatch(r"[A-Za-z][A-Za-z \-']{2,30}", head):
            out.append((head, body))
        if len(out) >= limit:
            break
    return out


def fortunes(lang: str) -> list[str]:
    """Quotes/jokes; `lang` 'en' (fortunes) or 'de' (fortunes-de). Offensive sets are not installed."""
    root = FORTUNES / "de" if lang == "de" else FORTUNES
    out = []
    for f in sorted(root.iterdir()):
        if f.suffix or not f.is_file() or f.name in ("art", "ascii-art", "asciiart", "translate-me"):
            continue
        for q in open(f, errors="replace").read().split("\n%\n"):
            q = re.sub(r"\n\s*--.*$", "", q.strip(), flags=re.S)  # drop the attribution
            q = re.sub(r"[ \t]+", " ", q).strip()
            if not re.search(r"\n\s*\n|^\s", q):  # plain prose: reflow wrapped lines
                q = re.sub(r"\s*\n\s*", " ", q)
            if 20 < len(q) < 700 and q.count("\n") < 10:
                out.append(q)
    return out
