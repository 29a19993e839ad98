"""NodeIdentity: the persisted node id, the per-process boot nonce, and the duplicate-id rule."""

from __future__ import annotations

import logging
import re

import pytest

from exo.cluster.identity import NODE_ID_FILE, NodeIdentity

HEX32 = re.compile(r"^[0-9a-f]{32}$")
LOGGER = "exo.cluster.identity"


def _stored(home) -> str:
    return (home / NODE_ID_FILE).read_text()


def test_created_and_persisted(tmp_path):
    home = tmp_path / "home" / "nested"  # created on demand
    ident = NodeIdentity(home)
    assert HEX32.match(ident.node_id)
    assert _stored(home) == ident.node_id + "\n"
    assert ident.previous_ids == []
    # No temp files left behind by the atomic write.
    assert sorted(p.name for p in home.iterdir()) == [NODE_ID_FILE]


def test_reused_on_restart_with_a_new_boot_nonce(tmp_path):
    first = NodeIdentity(tmp_path)
    second = NodeIdentity(tmp_path)
    assert second.node_id == first.node_id
    assert first.boot_nonce > 0 and second.boot_nonce > 0
    assert first.boot_nonce != second.boot_nonce  # 63 random bits each


def test_existing_id_with_whitespace_is_kept(tmp_path):
    (tmp_path / NODE_ID_FILE).write_text("  " + "ab" * 16 + "\n\n")
    assert NodeIdentity(tmp_path).node_id == "ab" * 16


@pytest.mark.parametrize(
    "garbage",
    ["not an id", "AB" * 16, "ab" * 17, "xyz" + "a" * 29],
    ids=["text", "uppercase", "too-long", "not-hex"],
)
def test_garbage_file_is_replaced_with_a_log_line(tmp_path, caplog, garbage):
    (tmp_path / NODE_ID_FILE).write_text(garbage)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        ident = NodeIdentity(tmp_path)
    assert HEX32.match(ident.node_id)
    assert _stored(tmp_path) == ident.node_id + "\n"
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert len(lines) == 1 and "not a node id: writing a new one" in lines[0]
    assert repr(garbage[:40]) in lines[0]


def test_binary_garbage_is_replaced(tmp_path, caplog):
    (tmp_path / NODE_ID_FILE).write_bytes(b"\xff\xfe\x00 not text")
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        ident = NodeIdentity(tmp_path)
    assert HEX32.match(ident.node_id) and _stored(tmp_path) == ident.node_id + "\n"
    assert any("not a node id" in r.getMessage() for r in caplog.records if r.name == LOGGER)


def test_empty_file_is_replaced_silently(tmp_path, caplog):
    (tmp_path / NODE_ID_FILE).write_text("")
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        ident = NodeIdentity(tmp_path)
    assert HEX32.match(ident.node_id) and _stored(tmp_path).strip() == ident.node_id
    assert not [r for r in caplog.records if r.name == LOGGER]


def test_regenerate_persists_and_logs(tmp_path, caplog):
    ident = NodeIdentity(tmp_path)
    old = ident.node_id
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        new = ident.regenerate("was copied")
    assert new == ident.node_id != old and HEX32.match(new)
    assert ident.previous_ids == [old]
    assert _stored(tmp_path) == new + "\n"
    assert NodeIdentity(tmp_path).node_id == new  # a restart keeps the new id
    (line,) = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert f"node id {old} was copied: this node is now {new}" in line


def test_larger_nonce_takes_a_new_id(tmp_path, caplog):
    ident = NodeIdentity(tmp_path, boot_nonce=500)
    old = ident.node_id
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert ident.resolve_duplicate(499, "10.0.0.2:52415") is True
    assert ident.node_id != old and ident.previous_ids == [old]
    assert _stored(tmp_path).strip() == ident.node_id
    (line,) = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert "10.0.0.2:52415" in line and "this node has the larger boot nonce and takes a new id" in line
    assert old in line and ident.node_id in line


def test_smaller_nonce_keeps_its_id(tmp_path, caplog):
    ident = NodeIdentity(tmp_path, boot_nonce=500)
    old = ident.node_id
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert ident.resolve_duplicate(501, "10.0.0.2:52415") is False
    assert ident.node_id == old and ident.previous_ids == []
    assert _stored(tmp_path).strip() == old
    (line,) = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert "that node has the larger boot nonce" in line and "10.0.0.2:52415" in line


def test_same_nonce_is_this_process(tmp_path, caplog):
    ident = NodeIdentity(tmp_path, boot_nonce=500)
    old = ident.node_id
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        assert ident.resolve_duplicate(500, "127.0.0.1:52415") is False
    assert ident.node_id == old and _stored(tmp_path).strip() == old
    assert not [r for r in caplog.records if r.name == LOGGER]
