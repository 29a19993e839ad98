"""Downloads through the real huggingface_hub client against a local hub (HF_ENDPOINT): full, dropped and
resumed, killed and resumed, offline, per stage, disk check, tokens, errors, two processes at once, and
checkpoints that do not match their config or index."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from huggingface_hub import hf_hub_download

from exo.cards import UnknownModelError
from exo.downloads import (
    CheckpointRejectedError,
    HubConfig,
    HubUnavailableError,
    InsufficientDiskError,
    OfflineFilesMissingError,
    ProgressTracker,
    RepoNotFoundError,
    Stage,
    fetch,
    plan_download,
)
from exo.downloads.checks import stage_missing_files
from exo.downloads.fetch import human_bytes
from exo.engine import ModelNotAvailableError, load_checkpoint, resolve_model
from exo.engine.hf_cache import cached_snapshot

from .conftest import pull_model

REPO = "org/tiny"
SHARD1, SHARD2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
SRC = Path(__file__).resolve().parents[2] / "src"


def exo_pull(*args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    return subprocess.Popen([sys.executable, "-m", "exo.cli.main", "pull", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_until(condition, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def test_full_download_with_progress(hub, checkpoint):
    source = checkpoint("qwen3_5")
    hub.add_repo(REPO, source)
    snapshots = []
    result = pull_model(REPO, tracker=ProgressTracker(listener=snapshots.append))

    files = sorted(p.name for p in source.iterdir())
    total = sum((source / f).stat().st_size for f in files)
    assert (result.files_fetched, result.bytes_fetched, result.files_cached) == (len(files), total, 0)
    assert result.head is not None and result.head.status == "present"
    path = Path(result.path)
    assert all((path / f).read_bytes() == (source / f).read_bytes() for f in files)
    assert f"downloaded 8 file(s), {human_bytes(total)}" in result.summary_lines()[0]

    done = [s.bytes_done for s in snapshots]
    assert done == sorted(done) and done[-1] == total  # monotonic, and it ends at the total
    assert {s.bytes_total for s in snapshots if s.status == "downloading"} <= {0, total}  # 0: not planned yet
    assert [s for s in snapshots if 0 < s.bytes_done < total]  # progress was seen part-way
    statuses = list(dict.fromkeys(s.status for s in snapshots))
    assert statuses == ["downloading", "validating", "complete"]
    assert snapshots[-1].files_done == snapshots[-1].files_total == len(files)

    # exo finds it where huggingface_hub put it, and a second pull fetches nothing.
    assert resolve_model(REPO).path == path
    before = len(hub.gets(REPO))
    again = pull_model(REPO)
    assert (again.files_fetched, again.files_cached) == (0, len(files))
    assert len(hub.gets(REPO)) == before


def test_a_dropped_connection_resumes_where_it_stopped(hub):
    # huggingface_hub writes in 10 MiB chunks: a file cut after 11 MiB resumes at 10 MiB with a Range request.
    data = np.random.default_rng(0).bytes(12 << 20)
    hub.add_repo("org/big", {"blob.dat": data, "config.json": b"{}"})
    hub.cut_once("org/big", "blob.dat", after=11 << 20)
    config = HubConfig.from_env()
    plan = plan_download("org/big", config)
    path = fetch(plan, config, ProgressTracker())

    assert (path / "blob.dat").read_bytes() == data
    first, second = hub.gets("org/big", "blob.dat")
    assert (first.range, first.sent) == (None, 11 << 20)
    assert (second.status, second.range, second.sent) == (206, f"bytes={10 << 20}-", 2 << 20)


def test_a_killed_pull_leaves_no_partial_file_taken_for_whole_and_resumes(hub, checkpoint):
    source = checkpoint("qwen3_5")
    other = "consolidated.pth"  # a file `exo pull` skips: another tool downloads it meanwhile
    hub.add_repo(REPO, {**{p.name: p.read_bytes() for p in source.iterdir()}, other: bytes(1 << 20)})
    gate = hub.gates[(REPO, SHARD2)] = threading.Event()
    child = exo_pull(REPO)
    try:
        # Every other file arrives; the second shard's body hangs until the process is killed.
        wait_until(lambda: len(hub.fetched_files(REPO)) == 7 and any(p.endswith(SHARD2) for p in hub.started))
        time.sleep(0.3)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    gate.set()
    cache = HubConfig.from_env().cache_dir
    orphans = list(cache.rglob("*.incomplete"))
    assert len(orphans) == 1  # the killed download's partial file stays behind...
    assert cached_snapshot(REPO) is None  # ...but never counts: the snapshot is not complete
    with pytest.raises(UnknownModelError):
        resolve_model(REPO)

    # A download in flight (another client, this process) holds its file's lock while it writes.
    other_gate = hub.gates[(REPO, other)] = threading.Event()
    client = threading.Thread(target=hf_hub_download, args=(REPO, other), kwargs=HubConfig.from_env().common())
    client.start()
    try:
        wait_until(lambda: any(p.endswith(other) for p in hub.started))
        in_flight = set(cache.rglob("*.incomplete")) - set(orphans)
        assert len(in_flight) == 1
        result = pull_model(REPO)
        assert not any(p.exists() for p in orphans)  # the new pull deleted the orphan...
        assert all(p.exists() for p in in_flight)  # ...not the partial file of a download in flight
    finally:
        other_gate.set()
        client.join(60)
    assert not list(cache.rglob("*.incomplete"))
    assert (result.files_fetched, result.files_cached) == (1, 7)  # only the unfinished shard again
    assert all(len(hub.gets(REPO, f.name)) == 1 for f in source.iterdir() if f.name != SHARD2)
    assert cached_snapshot(REPO) == Path(result.path)
    load_checkpoint(result.path, lazy=True)


def test_offline_uses_the_cache_only_and_names_what_is_missing(hub, checkpoint, monkeypatch):
    hub.add_repo(REPO, checkpoint("qwen3_5"))
    for variable in ("EXO_OFFLINE", "HF_HUB_OFFLINE"):
        monkeypatch.setenv(variable, "1")
        with pytest.raises(OfflineFilesMissingError, match=rf"offline .*{REPO} is not in the Hugging Face cache"):
            pull_model(REPO)
        monkeypatch.delenv(variable)
    assert hub.log == []

    pull_model(REPO, stage=Stage.of(0, 2, 4))  # online: the first stage only
    monkeypatch.setenv("EXO_OFFLINE", "1")
    with pytest.raises(OfflineFilesMissingError, match=rf"partly in the Hugging Face cache.*missing {SHARD2}") as e:
        pull_model(REPO)
    assert isinstance(e.value, ModelNotAvailableError) and e.value.missing == [SHARD2]
    assert pull_model(REPO, stage=Stage.of(0, 2, 4)).files_fetched == 0  # what is cached still works

    monkeypatch.delenv("EXO_OFFLINE")
    pull_model(REPO)
    monkeypatch.setenv("EXO_OFFLINE", "1")
    requests = len(hub.log)
    result = pull_model(REPO)
    assert result.files_fetched == 0 and result.head.status == "present" and len(hub.log) == requests


def test_a_stage_fetches_only_the_shards_of_its_layers(hub, checkpoint):
    hub.add_repo(REPO, checkpoint("qwen3_5"))
    first = pull_model(REPO, stage=Stage.of(0, 2, 4))
    assert SHARD1 in hub.fetched_files(REPO) and SHARD2 not in hub.fetched_files(REPO)
    assert first.stage == {"start": 0, "end": 2, "n_layers": 4, "first": True, "last": False}
    assert stage_missing_files(Path(first.path), Stage.of(0, 2, 4)) == []
    assert stage_missing_files(Path(first.path), Stage.of(2, 4, 4)) == [SHARD2]
    assert cached_snapshot(REPO) is None  # a stage's files are not the whole model

    last = pull_model(REPO, stage=Stage.of(2, 4, 4))
    assert last.files_fetched == 1 and len(hub.gets(REPO, SHARD1)) == 1  # the embedding's shard was cached
    assert cached_snapshot(REPO) == Path(last.path)


def test_the_free_disk_is_checked_before_anything_is_fetched(hub, checkpoint):
    hub.add_repo(REPO, checkpoint("qwen3_5"))
    with pytest.raises(InsufficientDiskError, match=r"8 file\(s\) need .* KB and .* must stay free, but .* free"):
        pull_model(REPO, reserve_bytes=1 << 60)
    assert hub.gets(REPO) == []


def test_tokens_unknown_repos_and_an_unreachable_hub(hub, checkpoint, monkeypatch):
    hub.add_repo("org/private", checkpoint("qwen3_5"), token="hf_secret")
    with pytest.raises(RepoNotFoundError, match="org/private was not found on .*a private repo needs HF_TOKEN"):
        pull_model("org/private")
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    assert pull_model("org/private").files_fetched == 8
    with pytest.raises(RepoNotFoundError, match="org/nothing was not found"):
        pull_model("org/nothing")
    with pytest.raises(UnknownModelError):
        pull_model("not a model")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    with pytest.raises(HubUnavailableError, match="cannot be reached.*EXO_OFFLINE=1"):
        pull_model("org/elsewhere")


def test_two_processes_pulling_one_repo_fetch_each_file_once(hub, checkpoint):
    source = checkpoint("qwen3_5", layout="mlx")
    hub.add_repo(REPO, source)
    weights = "model.safetensors"
    gate = hub.gates[(REPO, weights)] = threading.Event()
    child = exo_pull(REPO)  # one process: `exo pull`; the other: this one, fetching the same files
    try:
        wait_until(lambda: any(p.endswith(weights) for p in hub.started))  # the child is fetching it
        config = HubConfig.from_env()
        ours: list[Path] = []
        thread = threading.Thread(target=lambda: ours.append(fetch(plan_download(REPO, config), config,
                                                                   ProgressTracker())))
        thread.start()
        # This process asks for the same file while the child holds it: it waits on the file's lock.
        wait_until(lambda: sum(e.method == "HEAD" and e.path.endswith(weights) for e in hub.log) == 2)
        time.sleep(0.2)
        gate.set()
        thread.join(60)
        out, err = child.communicate(timeout=120)
    finally:
        gate.set()
        child.kill()
    assert child.returncode == 0, err
    assert "org/tiny@" in out
    assert {f: len(hub.gets(REPO, f)) for f in hub.fetched_files(REPO)} == {p.name: 1 for p in source.iterdir()}
    path = cached_snapshot(REPO)
    assert ours == [path] and (path / weights).read_bytes() == (source / weights).read_bytes()


def _edited_copy(source: Path, target: Path, edit) -> Path:
    shutil.copytree(source, target)
    edit(target)
    return target


def test_checkpoints_that_do_not_match_their_config_or_index_are_rejected(hub, checkpoint, tmp_path):
    def wider(path: Path) -> None:
        config = json.loads((path / "config.json").read_text())
        config["text_config"]["intermediate_size"] *= 2
        (path / "config.json").write_text(json.dumps(config))

    def misplaced(path: Path) -> None:
        index = json.loads((path / "model.safetensors.index.json").read_text())
        index["weight_map"]["lm_head.weight"] = SHARD1
        (path / "model.safetensors.index.json").write_text(json.dumps(index))

    wider_dir = _edited_copy(checkpoint("qwen3_5"), tmp_path / "wider", wider)
    hub.add_repo("org/wider", wider_dir)
    with pytest.raises(CheckpointRejectedError, match=r"rejected: .*shape"):
        pull_model("org/wider")
    # Every file is in the cache, but a rejected checkpoint is no model on this disk.
    assert cached_snapshot("org/wider") is None
    with pytest.raises(UnknownModelError):
        resolve_model("org/wider")
    # A snapshot another tool completed (its ref written, every file there) is found as broken by a pull
    # that fetches nothing, which leaves its ref alone: not exo's to delete.
    [snapshot] = (Path(os.environ["HF_HOME"]) / "hub" / "models--org--wider" / "snapshots").iterdir()
    ref = snapshot.parents[1] / "refs" / "main"
    ref.parent.mkdir(exist_ok=True)
    ref.write_text(snapshot.name)
    with pytest.raises(CheckpointRejectedError, match=r"rejected: .*shape"):
        pull_model("org/wider")
    assert ref.read_text() == snapshot.name and cached_snapshot("org/wider") == snapshot
    # A stage's download cannot check shapes (the rest of the model is not there) and records the ref; the
    # whole model's rejection takes it back, and a stage whose files complete the model checks it whole.
    hub.add_repo("org/wider-staged", wider_dir)
    pull_model("org/wider-staged", stage=Stage.of(0, 2, 4))
    with pytest.raises(CheckpointRejectedError, match=r"rejected: .*shape"):
        pull_model("org/wider-staged")
    assert cached_snapshot("org/wider-staged") is None
    with pytest.raises(CheckpointRejectedError, match=r"rejected: .*shape"):
        pull_model("org/wider-staged", stage=Stage.of(2, 4, 4))
    assert cached_snapshot("org/wider-staged") is None
    hub.add_repo("org/misplaced", _edited_copy(checkpoint("qwen3_5"), tmp_path / "misplaced", misplaced))
    with pytest.raises(CheckpointRejectedError, match=rf"{SHARD1} does not match model.safetensors.index.json"):
        pull_model("org/misplaced")


@pytest.mark.parametrize("missing", [None, "model.safetensors.index.json", SHARD2, "config.json"])
def test_a_snapshot_another_tool_left_half_done_is_not_a_checkpoint(checkpoint, tmp_path, monkeypatch, missing):
    # No file listing in the cache (huggingface-cli of an older huggingface_hub, hf_hub_download of single
    # files): exo's own check decides, from config.json and the index.
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    source = checkpoint("qwen3_5")
    folder = tmp_path / "hf" / "hub" / "models--org--tiny"
    snapshot = folder / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    for file in source.iterdir():
        if file.name != missing:
            (snapshot / file.name).symlink_to(file)
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text("a" * 40)
    assert cached_snapshot(REPO) == (snapshot if missing is None else None)
