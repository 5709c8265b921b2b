"""runtime/user_cache.py: records kept between runs where the environment says, the newest last and the oldest
dropped past MAX_ENTRIES, replaced atomically; a cache that is off, unreadable or unwritable is ignored."""

import json

from specbuild.runtime import user_cache


def test_records_are_kept_where_the_environment_says(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECBUILD_CACHE_DIR", str(tmp_path / "explicit"))
    assert user_cache.cache_dir() == tmp_path / "explicit"
    user_cache.put("kind", "key", {"ms": 1.5})
    assert user_cache.get("kind", "key") == {"ms": 1.5} and user_cache.get("kind", "other") is None
    assert json.loads((tmp_path / "explicit" / "kind.json").read_text()) == {"key": {"ms": 1.5}}
    assert not [p for p in (tmp_path / "explicit").iterdir() if p.name.endswith(".tmp")]  # no temporary left
    monkeypatch.setenv("SPECBUILD_CACHE_DIR", "")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert user_cache.cache_dir() == tmp_path / "xdg" / "specbuild"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert user_cache.cache_dir() == tmp_path / "home" / ".cache" / "specbuild"
    for off in ("off", "0"):
        monkeypatch.setenv("SPECBUILD_CACHE_DIR", off)
        assert user_cache.cache_dir() is None
        user_cache.put("kind", "key", 1)  # nothing written, nothing read
        assert user_cache.get("kind", "key") is None


def test_the_newest_record_stays_and_the_oldest_go(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECBUILD_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(user_cache, "MAX_ENTRIES", 3)
    for i in range(5):
        user_cache.put("kind", f"k{i}", i)
    user_cache.put("kind", "k2", "again")  # a record written again becomes the newest
    user_cache.put("kind", "k5", 5)
    assert list(json.loads((tmp_path / "kind.json").read_text())) == ["k4", "k2", "k5"]


def test_an_unreadable_or_unwritable_cache_is_ignored(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECBUILD_CACHE_DIR", str(tmp_path))
    (tmp_path / "kind.json").write_text("{not json")
    assert user_cache.get("kind", "key") is None
    user_cache.put("kind", "key", 7)  # a broken file is replaced
    assert user_cache.get("kind", "key") == 7
    (tmp_path / "list.json").write_text("[1, 2]")  # JSON, but not a mapping
    assert user_cache.get("list", "key") is None
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("SPECBUILD_CACHE_DIR", str(blocker / "below"))  # a directory that cannot be made
    user_cache.put("kind", "key", 1)
    assert user_cache.get("kind", "key") is None
