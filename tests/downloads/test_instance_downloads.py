"""Instances whose weights a node lacks: the supervisor lists them while the node's DownloadManager fetches
their files from the local hub (the real huggingface_hub client), then starts the runner.

What the daemons show end to end is in tests/cluster/test_download_cluster.py; here, what only shows
between the supervisor and the downloads: an instance stopped or killed while its weights are downloading
goes at once, its download goes on (it may be shared); two instances share one download; a running download
of the whole model serves a stage; a cancelled download fails the instance; who may download at all.
"""

from __future__ import annotations

import asyncio
import functools
import threading
import time
from pathlib import Path

import pytest

from exo.cards import load_catalog
from exo.cluster.fetching import InstanceDownloadError, InstanceFetcher
from exo.cluster.supervisor import InstanceSupervisor
from exo.downloads import DownloadManager, HubConfig, InProcessSteps, Stage
from exo.wire.proto_gen import node_pb2 as pb

from .conftest import write_card

pytestmark = pytest.mark.timeout(120)

REPO = "org/tiny"
SHARD1, SHARD2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"


@pytest.fixture
def fetcher(hub, checkpoint):
    source = checkpoint("qwen3_5")
    hub.add_repo(REPO, source)
    write_card("tiny", REPO, source, source_repo=None)
    manager = DownloadManager(steps=InProcessSteps(), catalog=load_catalog)
    yield InstanceFetcher(manager, load_catalog, offline=lambda: False)
    manager.close()


async def until(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


def test_an_instance_downloading_goes_at_once_when_killed_or_stopped_and_its_download_goes_on(
    fetcher, hub, tmp_path
):
    gate = hub.gates[(REPO, SHARD1)] = threading.Event()
    card = load_catalog().get("tiny")
    stage = Stage.of(0, 2, 4)  # the raw fixture's stage [0, 2) needs shard 1 only
    fetch = functools.partial(fetcher.fetch, card, stage)
    shard = pb.Shard(start_layer=0, end_layer=2, rank=0, world_size=2)

    async def scenario() -> None:
        sup = InstanceSupervisor(tmp_path / "home", node_id=lambda: "node-a")
        first = await sup.fetch_and_start("i1", "tiny", fetch, shard)
        assert first.state == pb.INSTANCE_STATE_LOADING and first.stage == "downloading" and first.pid == 0
        await until(lambda: sup.get("i1").download_id and any(p.endswith(SHARD1) for p in hub.started))
        listed = sup.get("i1")
        assert listed.download.status == "downloading" and listed.download.bytes_total > 0
        download = fetcher.manager.get(listed.download_id)

        await sup.fetch_and_start("i2", "tiny", fetch, shard)  # another instance of the same stage
        await until(lambda: sup.get("i2").download_id)
        assert sup.get("i2").download_id == download.id  # one download for both

        assert sup.kill("i1", "its pipeline broke: stage 1 left")
        killed = sup.get("i1")
        assert killed.state == pb.INSTANCE_STATE_FAILED and killed.failure.message.endswith("stage 1 left")
        started = time.monotonic()
        assert await sup.stop("i2")
        # Waiting for the shared download (held at its gate until below) would never end: seconds is "at once".
        assert time.monotonic() - started < 10.0 and sup.get("i2") is None
        assert not download.finished  # neither took the shared download down with it
        gate.set()
        await until(lambda: download.finished)
        assert download.tracker.status == "complete"
        await sup.close()

    asyncio.run(scenario())
    cache = HubConfig.from_env().cache_dir
    assert list(cache.rglob(f"snapshots/*/{SHARD1}")) and not list(cache.rglob(f"snapshots/*/{SHARD2}"))


def test_a_whole_download_serves_a_stage_and_a_cancelled_one_fails_it(fetcher, hub):
    gate = hub.gates[(REPO, SHARD2)] = threading.Event()
    card = load_catalog().get("tiny")
    whole, _ = fetcher.manager.start("tiny")
    reported: list[str] = []

    async def scenario() -> None:
        task = asyncio.create_task(fetcher.fetch(card, Stage.of(2, 4, 4), lambda i, _: reported.append(i)))
        await until(lambda: reported)
        await asyncio.to_thread(fetcher.manager.cancel, whole.id, 0.5)
        gate.set()
        with pytest.raises(
            InstanceDownloadError,
            match=r"downloading layers \[2, 4\) of tiny \(org/tiny\) "
            r"failed: the download was cancelled",
        ):
            await task

    asyncio.run(scenario())
    assert set(reported) == {whole.id}  # the stage waited on the whole model's download, fetched nothing else


def test_planning_errors_fail_the_fetch_with_the_reason(fetcher, hub):
    card = load_catalog().get("tiny")
    hub.repos.pop(REPO)
    with pytest.raises(
        InstanceDownloadError, match=r"downloading tiny \(org/tiny\) failed: org/tiny was not found"
    ):
        asyncio.run(fetcher.fetch(card, None, lambda *_: None))


def test_who_downloads(fetcher, tmp_path):
    assert fetcher.downloadable_card("tiny").repo == REPO
    assert fetcher.downloadable_card(REPO).id == "tiny"  # by its repo too
    assert fetcher.downloadable_card("exo-demo") is None  # bundled: nothing to download
    assert fetcher.downloadable_card("no-such-model") is None
    offline = InstanceFetcher(fetcher.manager, load_catalog, offline=lambda: True)
    assert offline.downloadable_card("tiny") is None
    card = load_catalog().get("tiny")
    assert InstanceFetcher.stage_of(card, None) is None
    assert InstanceFetcher.stage_of(card, pb.Shard(world_size=1)) is None
    assert InstanceFetcher.stage_of(
        card, pb.Shard(start_layer=2, end_layer=0, rank=1, world_size=2)
    ) == Stage.of(2, 4, 4)
    assert Path(HubConfig.from_env().cache_dir).exists() is False  # none of this touched the hub
