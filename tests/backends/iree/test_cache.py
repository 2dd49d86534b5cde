"""The compile cache's directory (on by default, in the user's cache directory), its switch and its bound."""

from __future__ import annotations

import os
import time

from fx_rewrites.backends.iree.cache import CACHE_ENV, CACHE_SIZE_ENV, CompileCache, default_directory


def test_the_disk_cache_is_on_by_default_in_the_users_cache_directory(monkeypatch, tmp_path):
    monkeypatch.delenv(CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_directory() == tmp_path / "xdg" / "fx-rewrites" / "iree"
    cache = CompileCache()
    assert cache.get_or_compile("k", lambda: b"vmfb") == (b"vmfb", False)
    assert (tmp_path / "xdg" / "fx-rewrites" / "iree" / "k.vmfb").read_bytes() == b"vmfb"
    assert CompileCache().get_or_compile("k", lambda: b"other") == (b"vmfb", True)  # another process, in effect
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert str(default_directory()) == os.path.expanduser("~/.cache/fx-rewrites/iree")


def test_off_and_an_explicit_directory(monkeypatch, tmp_path):
    for off in ("0", "off", "OFF"):
        monkeypatch.setenv(CACHE_ENV, off)
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
        CompileCache().get_or_compile("k", lambda: b"vmfb")
        assert not (tmp_path / "xdg").exists()
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "here"))
    CompileCache().get_or_compile("k", lambda: b"vmfb")
    assert (tmp_path / "here" / "k.vmfb").is_file()
    CompileCache(directory=tmp_path / "there").get_or_compile("k", lambda: b"vmfb")  # the argument wins
    assert (tmp_path / "there" / "k.vmfb").is_file()


def test_past_its_bound_the_least_recently_used_go(monkeypatch, tmp_path):
    cache = CompileCache(directory=tmp_path, max_bytes=250)
    for i, key in enumerate("abc"):
        cache.get_or_compile(key, lambda: b"x" * 100)
        os.utime(tmp_path / f"{key}.vmfb", (time.time() - 100 + i, time.time() - 100 + i))
    # a and b fit (200 bytes); c made 300: a, the oldest, went
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.vmfb", "c.vmfb"]
    assert CompileCache(directory=tmp_path).get_or_compile("b", lambda: b"new") == (b"x" * 100, True)  # b used now
    cache.clear()
    cache.get_or_compile("d", lambda: b"x" * 100)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.vmfb", "d.vmfb"]  # c was the least recently used
    monkeypatch.setenv(CACHE_SIZE_ENV, "0.0001")  # MB: 104 bytes
    CompileCache(directory=tmp_path).get_or_compile("e", lambda: b"x" * 100)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e.vmfb"]


def test_a_second_process_compiling_the_same_key_waits_for_the_first(tmp_path):
    """The ranks of a tensor-parallel model compile one program at once: the second waits for the first's module
    (a lock on the cache entry) instead of compiling it too. Two caches over one directory, in two threads: each
    takes its own `flock`, as two processes do."""
    import threading

    compiled: list[str] = []
    started, release = threading.Event(), threading.Event()

    def first() -> bytes:
        compiled.append("first")
        started.set()
        release.wait(30)
        return b"first's module"

    def second() -> bytes:
        compiled.append("second")
        return b"second's module"

    results: dict[str, tuple[bytes, bool]] = {}
    a = threading.Thread(target=lambda: results.update(a=CompileCache(directory=tmp_path).get_or_compile("k", first)))
    b = threading.Thread(target=lambda: results.update(b=CompileCache(directory=tmp_path).get_or_compile("k", second)))
    a.start()
    assert started.wait(30)
    b.start()
    b.join(0.5)  # without the lock it compiles at once; with it, it waits for the first
    release.set()
    a.join(30)
    b.join(30)
    assert compiled == ["first"]
    assert results == {"a": (b"first's module", False), "b": (b"first's module", True)}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["k.vmfb"]  # the lock file went with the compile


def test_a_failed_compile_lets_the_waiting_one_compile(tmp_path):
    import threading

    started, release = threading.Event(), threading.Event()

    def failing() -> bytes:
        started.set()
        release.wait(30)
        raise RuntimeError("iree-compile failed")

    errors: list[Exception] = []

    def run_failing() -> None:
        try:
            CompileCache(directory=tmp_path).get_or_compile("k", failing)
        except RuntimeError as e:
            errors.append(e)

    results = {}
    a = threading.Thread(target=run_failing)
    b = threading.Thread(
        target=lambda: results.update(b=CompileCache(directory=tmp_path).get_or_compile("k", lambda: b"m"))
    )
    a.start()
    assert started.wait(30)
    b.start()
    b.join(0.5)
    release.set()
    a.join(30)
    b.join(30)
    assert [str(e) for e in errors] == ["iree-compile failed"]
    assert results == {"b": (b"m", False)}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["k.vmfb"]
