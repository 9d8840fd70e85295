"""The shared-memory weight transport (inflight/transport/shm.py) against two real `inflight serve` processes: the
trainer (this process) writes each update once, both servers copy it in; logprobs are compared with an independent
transformers forward. Then every way a segment can be wrong is refused before anything is applied."""

from __future__ import annotations

import concurrent.futures as cf
import os
import re
import time

import httpx
import pytest
import torch

from inflight.engine.weights.receiver import WeightUpdateError, check_finite
from inflight.trainer.weight_sync.common import WeightSyncError
from inflight.trainer.weight_sync.inflight import WeightSyncClient
from inflight.transport.layout import shm_layout
from inflight.transport.schemas import ParamInfo
from inflight.transport.shm import SHM_HEADER_BYTES, ShmError, ShmWriter, announcement_digest, progress_is_ordered
from tests.test_weight_sync import chat, check_matches, fingerprint, perturbed

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def servers(tiny_model_dir):
    from inflight.engine.serve import ServerProcess

    env = {"OMP_NUM_THREADS": "1", "INFLIGHT_SHM_STALL_S": "2"}  # a trainer that stopped: a 409 after 2 s
    args = ["--max-model-len", "512", "--no-prefix-reuse"]  # bit-reproducible fingerprints (test_weight_sync.py)
    with ServerProcess(str(tiny_model_dir), extra_args=args, env=env) as a, \
            ServerProcess(str(tiny_model_dir), extra_args=args, env=env) as b:
        yield [a, b]


@pytest.fixture(scope="module")
def hf(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture()
def shm(servers):
    c = WeightSyncClient([s.url for s in servers], transport="shm", timeout_s=60)
    yield c
    c.close()


def test_one_segment_reaches_every_server_and_rewriting_it_changes_nothing(servers, hf, shm):
    new = perturbed(hf, seed=1)
    stats = shm.push(new.items(), version=1)
    assert stats["bytes"] == sum(t.numel() * 4 for t in new.values())
    first = shm._shm.path
    assert first.startswith("/dev/shm/") and os.path.getsize(first) >= SHM_HEADER_BYTES + stats["bytes"]
    for s in servers:
        after = chat(s.url, temperature=0.8)
        assert set(after["token_versions"]) == {1}
        check_matches(hf, new, after, 0.8)
    newer = perturbed(hf, seed=2)
    shm.push(newer.items(), version=2, mode="interrupt")
    assert shm._shm.path == first  # the same announcement: the segment is written again
    refs = [fingerprint(s.url) for s in servers]
    with open(first, "r+b") as f:  # what writing the next update there does: the servers copied update 2
        f.seek(SHM_HEADER_BYTES)
        f.write(os.urandom(os.path.getsize(first) - SHM_HEADER_BYTES))
    for s, ref in zip(servers, refs):
        assert fingerprint(s.url) == ref
        check_matches(hf, newer, chat(s.url, temperature=1.0), 1.0)
    newest = perturbed(hf, seed=3)
    shm.push(newest.items(), version=3)
    assert shm._shm.path == first
    for s in servers:
        check_matches(hf, newest, chat(s.url, temperature=1.0), 1.0)
    partial = {n: t + 0.01 for n, t in list(newest.items())[::3]}  # another size: a new segment, the old one gone
    shm.push(partial.items(), version=4)
    assert shm._shm.path != first and not os.path.exists(first)
    for s in servers:
        check_matches(hf, {**newest, **partial}, chat(s.url, temperature=1.0), 1.0)
    shm.close()
    assert not os.path.exists(shm._shm.path or "/nonexistent")


def test_the_segment_is_reused(servers, hf):
    c = WeightSyncClient([s.url for s in servers], transport="shm", timeout_s=60)
    try:
        c.push(perturbed(hf, seed=11).items(), version=11)
        path = c._shm.path
        newer = perturbed(hf, seed=12)
        c.push(newer.items(), version=12)
        assert c._shm.path == path  # copied by every server: the trainer may write it again at once
        for s in servers:
            check_matches(hf, newer, chat(s.url, temperature=1.0), 1.0)
    finally:
        c.close()


def test_bad_segments_are_refused_and_change_nothing(servers, hf, shm, tmp_path):
    url = servers[0].url
    shm.push(perturbed(hf, seed=5).items(), version=13)  # versions never go back: after the tests before
    ref = fingerprint(url)
    seg, params = shm._shm.path, None
    good = perturbed(hf, seed=6)
    params = [{"name": n, "shape": list(t.shape), "dtype": "float32"} for n, t in good.items()]
    body = {"version": 13, "params": params, "shm": {"path": seg, "bytes": os.path.getsize(seg)}}

    def refused(b: dict, match: str) -> None:
        r = httpx.post(url + "/request_weight_update", json=b, timeout=30)
        assert r.status_code == 400 and match in r.json()["error"]["message"], r.text

    refused({**body, "version": 14}, "holds weight version 13, the update announces 14")  # stale segment
    swapped = [params[1], params[0], *params[2:]]  # same bytes in all, other tensors at the offsets
    refused({**body, "params": swapped}, "other tensors than announced")
    refused({**body, "shm": {"path": seg, "bytes": os.path.getsize(seg) + 64}}, "header 4096 + the announced")
    refused({**body, "shm": {"path": "/dev/shm/inflight-no-such-segment", "bytes": body["shm"]["bytes"]}},
            "trainer.weight_transport=process_group")
    fifo = str(tmp_path / "fifo")
    os.mkfifo(fifo)  # opening it would block the server: refused from its file type
    refused({**body, "shm": {"path": fifo, "bytes": body["shm"]["bytes"]}}, "not a readable inflight weight segment")
    with open(seg, "r+b") as f:  # a segment being written: its header is invalid until the data is complete
        f.write(b"\0" * 8)
    refused(body, "its header is being written")
    r = httpx.post(url + "/request_weight_update", json={**body, "bucket_bytes": 64}, timeout=30)
    assert r.status_code in (400, 422) and "bucket_bytes" in r.text
    assert fingerprint(url) == ref

    poisoned = dict(good)
    name = list(good)[3]
    poisoned[name] = good[name].clone()
    poisoned[name].view(-1)[7] = float("nan")
    with pytest.raises(WeightSyncError, match=rf"NaN or Inf values in \['{name}'\]"):
        shm.push(poisoned.items(), version=15)
    assert fingerprint(url) == ref  # nothing applied on either server
    assert shm._shm.path is None  # a failed update: the next push writes a new segment
    shm.push(good.items(), version=16)
    check_matches(hf, good, chat(url, temperature=1.0), 1.0)


def mapped_kb(pid: int, path: str) -> tuple[int, int] | None:
    """(Rss, Referenced) in kB of process `pid`'s mappings of file `path`, None while it maps none. Referenced counts
    the pages the process touched since its accessed bits were last cleared (clear_refs): what it has read."""
    found, inside = None, False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            if re.match(r"[0-9a-f]+-[0-9a-f]+ ", line):
                inside = line.rstrip("\n").endswith(" " + path)
                found = (found or (0, 0)) if inside else found
            elif inside and line.startswith(("Rss:", "Referenced:")):
                kb = int(line.split()[1])
                found = (found[0] + kb, found[1]) if line.startswith("Rss") else (found[0], found[1] + kb)
    return found


def until(cond, timeout_s: float = 60) -> bool:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def held_halfway(shm: WeightSyncClient, servers) -> dict:
    """Instead of timing the push, hold its writer: wait until every server maps the new segment (asked before a
    byte is written), clear the servers' accessed bits, write the first half of the tensors, and wait until every
    server has read data pages of the segment (beyond its header) before writing the rest. Records what it saw."""
    seen: dict = {}
    real = shm._shm.write_tensors

    def write(tensors, dtypes, offsets):
        path, half, pids = shm._shm.path, len(tensors) // 2, [s.proc.pid for s in servers]
        seen["mapped_before_writing"] = until(lambda: all(mapped_kb(p, path) for p in pids))
        for p in pids:
            with open(f"/proc/{p}/clear_refs", "w") as f:
                f.write("1")  # the servers' mapping stays; what they read from now on is counted again
        real(tensors[:half], dtypes[:half], offsets[:half])
        header_kb, half_kb = SHM_HEADER_BYTES // 1024, -(-offsets[half] // 4096) * 4
        seen["read_while_held"] = until(lambda: all(mapped_kb(p, path)[1] > header_kb for p in pids))
        seen["read_kb"], seen["bound_kb"] = [mapped_kb(p, path)[1] for p in pids], header_kb + half_kb
        seen["versions_while_held"] = [httpx.get(s.url + "/health", timeout=10).json()["version"] for s in servers]
        real(tensors[half:], dtypes[half:], offsets[half:])

    shm._shm.write_tensors = write
    return seen


def test_an_overlapped_push_is_exact_and_a_poisoned_last_tensor_changes_nothing(servers, hf, shm):
    """The servers are asked before the segment is written and copy it as it is written (x86-64): held halfway,
    the writer sees both servers read the written half (and nothing beyond it), with nothing applied yet; the
    weights they serve are the pushed ones. A NaN in the last tensor, written after the servers copied everything
    before it, still rejects the whole update on both, and nothing changes."""
    new = perturbed(hf, seed=40)
    before = [httpx.get(s.url + "/health", timeout=10).json()["version"] for s in servers]
    seen = held_halfway(shm, servers) if progress_is_ordered() else None
    try:
        stats = shm.push(new.items(), version=40)
    finally:
        shm._shm.__dict__.pop("write_tensors", None)
    if seen is not None:
        assert seen["mapped_before_writing"] and seen["read_while_held"], seen
        assert all(kb <= seen["bound_kb"] for kb in seen["read_kb"]), seen  # only what was written
        assert seen["versions_while_held"] == before != [40, 40]
    assert stats["write_s"] > 0
    for s in servers:
        check_matches(hf, new, chat(s.url, temperature=1.0), 1.0)
    refs = [fingerprint(s.url) for s in servers]
    for value in (float("nan"), float("inf")):
        poisoned = perturbed(hf, seed=41)
        last = list(poisoned)[-1]
        poisoned[last].view(-1)[-1] = value
        with pytest.raises(WeightSyncError, match=rf"NaN or Inf values in \['{last}'\]"):
            shm.push(poisoned.items(), version=41)
        assert [fingerprint(s.url) for s in servers] == refs
    shm.push(new.items(), version=42)  # a new segment after the failures
    for s in servers:
        check_matches(hf, new, chat(s.url, temperature=1.0), 1.0)


def _announce(weights: dict[str, torch.Tensor], version: int, writer: ShmWriter) -> tuple[dict, list[int]]:
    """What WeightSyncClient sends for transport=shm, the segment begun (state WRITING, nothing written yet)."""
    params = [ParamInfo(name=n, shape=list(t.shape), dtype="float32") for n, t in weights.items()]
    offsets, data_bytes = shm_layout(params)
    seg = writer.begin(data_bytes, version, announcement_digest(params))
    return {"version": version, "params": [p.model_dump() for p in params], "shm": seg}, offsets


@pytest.mark.parametrize("how", ["stops", "abandons"])
def test_a_trainer_that_fails_midway_changes_nothing(servers, hf, shm, how):
    """A trainer that stops writing (killed, hung) or marks its segment abandoned (an error while writing) after
    half of the tensors: the server answers 409 naming it (after INFLIGHT_SHM_STALL_S, here 2 s, or at once), its
    weights and version stay as they were, and the next push works."""
    url, v = servers[0].url, {"stops": 50, "abandons": 53}[how]  # versions never go back: one range per case
    shm.push(perturbed(hf, seed=50).items(), version=v)
    ref = fingerprint(url)
    items = list(perturbed(hf, seed=51).items())
    half = len(items) // 2
    writer = ShmWriter()
    try:
        body, offsets = _announce(dict(items), v + 1, writer)
        with cf.ThreadPoolExecutor(1) as pool:
            t0 = time.monotonic()
            answer = pool.submit(httpx.post, url + "/request_weight_update", json=body, timeout=60)
            writer.write_tensors(items[:half], ["float32"] * half, offsets[:half])
            if how == "abandons":
                time.sleep(0.5)  # the server is following the segment by now
                writer.abandon()
            since = time.monotonic()  # the abandon (stopping: the last write)
            r = answer.result()
            took, after = time.monotonic() - t0, time.monotonic() - since
    finally:
        writer.discard()
    msg = r.json()["error"]["message"]
    if how == "stops":
        assert r.status_code == 409 and "stopped writing" in msg and "nothing applied" in msg, r.text
        assert 2.0 <= took < 30
    else:
        assert r.status_code == 409 and "abandoned by the trainer" in msg and "nothing applied" in msg, r.text
        # at once: the stall timeout (2 s after the last write, 0.5 s before the abandon) is >= 1.5 s away; timed
        # from the abandon, as a busy core can stretch what comes before it
        assert after < 1.0, (took, after)
    assert fingerprint(url) == ref
    again = perturbed(hf, seed=52)
    shm.push(again.items(), version=v + 2)
    check_matches(hf, again, chat(url, temperature=1.0), 1.0)


def test_a_push_that_fails_while_writing_changes_nothing(servers, hf, shm):
    """The trainer's own write fails midway (the last tensor has no data: a meta tensor): the segment is marked
    abandoned, so both servers, already following it, answer at once instead of at their 2 s stall timeout; the
    trainer raises its own error, nothing is applied, and the next push uses a new segment."""
    shm.push(perturbed(hf, seed=60).items(), version=60)
    refs = [fingerprint(s.url) for s in servers]
    broken = perturbed(hf, seed=61)
    last = list(broken)[-1]
    broken[last] = torch.empty(broken[last].shape, device="meta")
    marks = {}
    real_abandon = shm._shm.abandon
    shm._shm.abandon = lambda: (marks.setdefault("abandoned", time.monotonic()), real_abandon())
    try:
        with pytest.raises(NotImplementedError, match="meta"):
            shm.push(broken.items(), version=61)
        after = time.monotonic() - marks["abandoned"]
    finally:
        shm._shm.__dict__.pop("abandon", None)
    # both answered at once: their stall timeout is 2 s after the last write, just before the abandon (timed from
    # the abandon, as a busy core can stretch the push before it)
    assert after < 1.5, after
    assert shm._shm.path is None
    assert [fingerprint(s.url) for s in servers] == refs
    good = perturbed(hf, seed=62)
    shm.push(good.items(), version=62)
    for s in servers:
        check_matches(hf, good, chat(s.url, temperature=1.0), 1.0)


def test_a_full_shm_directory_is_a_clear_error(tmp_path, monkeypatch):
    def no_space(fd, offset, length):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", no_space)
    w = ShmWriter(str(tmp_path))
    with pytest.raises(ShmError, match="docker --shm-size.*trainer.shm_dir"):
        w.write([("w", torch.ones(4))], ["float32"], [0], 16, 1, b"\0" * 32)
    assert os.listdir(tmp_path) == []  # nothing left behind


def test_fused_finite_check(monkeypatch):
    good = {"a": torch.randn(100, 10), "b": torch.randn(7).bfloat16(), "i": torch.arange(5)}
    check_finite(good)
    reads = []  # each bool() of a tensor is a host sync on a GPU: one per update, not one per tensor
    real = torch.Tensor.__bool__
    monkeypatch.setattr(torch.Tensor, "__bool__", lambda t: reads.append(1) or real(t))
    check_finite({f"w{i}": torch.randn(8, 8) for i in range(300)})
    assert len(reads) == 1
    monkeypatch.undo()
    huge = {"h1": torch.full((4,), 3e38), "h2": torch.full((4,), 3e38)}  # finite, but the float32 total overflows
    check_finite(huge)
    for bad in (float("nan"), float("inf"), float("-inf")):
        t = torch.randn(50, 3)
        t[17, 1] = bad
        with pytest.raises(WeightUpdateError, match=r"NaN or Inf values in \['x'\]"):
            check_finite({**good, "x": t})
    pos, neg = torch.zeros(3), torch.zeros(3)  # +inf in one tensor, -inf in another: caught, both named
    pos[0], neg[0] = float("inf"), float("-inf")
    with pytest.raises(WeightUpdateError, match=r"\['p', 'n'\]"):
        check_finite({"p": pos, "n": neg})


def test_a_segment_does_not_outlive_its_writer(tmp_path):
    """/dev/shm is memory: a writer dropped without close() (or at interpreter exit) removes its file."""
    import gc

    w = ShmWriter(str(tmp_path))
    w.write([("w", torch.ones(4))], ["float32"], [0], 16, 1, b"\0" * 32)
    path = w.path
    assert os.path.exists(path)
    del w
    gc.collect()
    assert not os.path.exists(path)
    w = ShmWriter(str(tmp_path))
    w.write([("w", torch.ones(4))], ["float32"], [0], 16, 1, b"\0" * 32)
    first = w.path
    w.write([("w", torch.ones(8))], ["float32"], [0], 32, 2, b"\0" * 32)  # another size: another file
    assert w.path != first and not os.path.exists(first)
    w.discard()
    assert os.listdir(tmp_path) == []
