"""Startup: library first-use JIT builds stay off the critical path; phases are logged as they start.

The selection logic is exercised with stand-in backend classes (no GPU here): a candidate whose library would
JIT-build first is neither timed nor chosen, a background build is started for it (once), the remembered answer is
keyed by what was pending, and a start after the build times it. Build markers count only while the library's cache
directory exists.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import types

import pytest
import torch

from hf_accel import api
from hf_accel.attention import prebuild
from hf_accel.attention.backend import AttentionBackend, AttentionSpec
from hf_accel.config import AccelConfig
from hf_accel.progress import StartupProgress

SPEC = AttentionSpec(num_heads=16, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
CUDA = torch.device("cuda", 0)


def _fake_backend(name: str, lib_cache: str | None = None) -> type[AttentionBackend]:
    attrs = {"name": name, "supported_block_sizes": (16,)}
    if lib_cache is not None:
        attrs.update(builds_on_first_use=True, library_version=classmethod(lambda cls: "1.0"),
                     library_cache_dir=classmethod(lambda cls: lib_cache))
    return type(f"Fake{name}", (AttentionBackend,), attrs)


@pytest.fixture
def world(tmp_path, monkeypatch):
    """Two candidates, "jitlib" (first in static order, builds on first use) and "ready"; everything patched."""
    lib_cache = tmp_path / "libcache"
    jit = _fake_backend("jitlib", str(lib_cache))
    ready = _fake_backend("ready")
    other = _fake_backend("other")
    classes = {"jitlib": jit, "ready": ready, "other": other}
    timed: list[list[str]] = []
    started: list[str] = []

    def autotune_backends(candidates, spec, device, block_size, **kw):
        timed.append([c.name for c in candidates])
        return candidates[-1], {c.name: {"decode_ms": 1.0, "prefill_ms": 1.0, "score": 5.0} for c in candidates}

    def start(name, spec, device, marker, block_size=None):
        started.append(name)

    monkeypatch.setattr(api, "load_backend_class", lambda name: (classes.get(name), None))
    monkeypatch.setattr(api, "auto_candidates", lambda spec, device: [classes[n] for n in world_names])
    monkeypatch.setattr(api, "select_backend", lambda name, spec, device: classes[world_names[0]])
    monkeypatch.setattr(api, "autotune_backends", autotune_backends)
    monkeypatch.setattr(prebuild, "start_background_build", start)
    monkeypatch.setattr(api, "BACKEND_NAMES", (*api.BACKEND_NAMES, *classes))
    monkeypatch.setattr(api, "backend_reasons", lambda name, spec, device: [])
    world_names = ["jitlib", "ready", "other"]
    model = types.SimpleNamespace(config=types.SimpleNamespace(num_hidden_layers=2))
    cfg = AccelConfig(compile_cache_dir=str(tmp_path / "cache")).resolve_for(torch.device("cpu"))
    cfg.cudagraph_mode = "full_and_piecewise"
    return types.SimpleNamespace(cfg=cfg, model=model, classes=classes, timed=timed, started=started,
                                 lib_cache=lib_cache, names=world_names, tmp=tmp_path)


def _choose(w):
    return api._choose_backend(w.model, w.cfg, SPEC, CUDA, list(w.names))


def test_unbuilt_library_is_not_timed_and_builds_in_the_background(world):
    chosen, info = _choose(world)
    assert world.timed == [["ready", "other"]]
    assert chosen.name == "other"
    assert "jitlib" in info["pending_builds"] and "JIT" in info["pending_builds"]["jitlib"]
    assert world.started == ["jitlib"]


def test_remembered_answer_is_reused_until_the_build_lands(world):
    _choose(world)
    world.started.clear()
    chosen, info = _choose(world)  # same pending set: the remembered answer, no timing
    assert info.get("cached") and chosen.name == "other" and world.timed == [["ready", "other"]]
    assert world.started == ["jitlib"]  # still pending: (re)started if no build is running
    # the build lands: its marker names an existing library cache
    world.lib_cache.mkdir()
    marker = world.classes["jitlib"].build_marker(SPEC, CUDA, world.cfg.compile_cache_dir)
    prebuild.mark_built(marker, str(world.lib_cache))
    world.started.clear()
    _choose(world)
    assert world.timed[-1] == ["jitlib", "ready", "other"]  # now timed with the others
    assert world.started == []


def test_marker_counts_only_while_the_library_cache_exists(world):
    world.lib_cache.mkdir()
    cls = world.classes["jitlib"]
    marker = cls.build_marker(SPEC, CUDA, world.cfg.compile_cache_dir)
    assert cls.pending_build(SPEC, CUDA, world.cfg.compile_cache_dir)
    prebuild.mark_built(marker, str(world.lib_cache))
    assert cls.pending_build(SPEC, CUDA, world.cfg.compile_cache_dir) is None
    world.lib_cache.rmdir()  # the user wiped the library's cache (or pointed it elsewhere): not built any more
    assert cls.pending_build(SPEC, CUDA, world.cfg.compile_cache_dir)


def test_other_shapes_and_versions_have_their_own_markers(world):
    cls = world.classes["jitlib"]
    a = cls.build_marker(SPEC, CUDA, world.cfg.compile_cache_dir)
    b = cls.build_marker(AttentionSpec(16, 8, 64, torch.bfloat16), CUDA, world.cfg.compile_cache_dir)
    c = prebuild.marker_path("jitlib", SPEC, CUDA, "2.0", str(world.lib_cache), world.cfg.compile_cache_dir)
    assert len({a, b, c}) == 3


def test_when_every_candidate_would_build_one_is_still_chosen(world):
    world.names[:] = ["jitlib"]
    chosen, info = _choose(world)
    assert chosen.name == "jitlib" and world.timed == [] and world.started == []


def test_background_builds_can_be_switched_off(world):
    world.cfg.background_builds = False
    _choose(world)
    assert world.started == []


def test_static_auto_without_autotune_skips_an_unbuilt_library(world):
    first = world.classes["jitlib"]
    assert api._static_auto_choice(first, world.cfg, SPEC, CUDA).name == "ready"
    assert world.started == ["jitlib"]


def test_builder_process_command_and_lock(tmp_path, monkeypatch):
    launched = {}

    class FakePopen:
        pid = 4242

        def __init__(self, cmd, **kw):
            launched["cmd"], launched["kw"] = cmd, kw

    monkeypatch.setattr(prebuild.subprocess, "Popen", FakePopen)
    # the lock names this (the starting) process until the builder writes its own pid
    monkeypatch.setattr(prebuild, "_pid_alive", lambda pid: pid in (4242, os.getpid()))
    monkeypatch.delenv(prebuild.ENV_DISABLE, raising=False)
    marker = tmp_path / "builds" / "flashinfer-abc.json"
    proc = prebuild.start_background_build("flashinfer", SPEC, CUDA, marker, block_size=16)
    assert proc is not None
    cmd = launched["cmd"]
    assert cmd[:3] == [sys.executable, "-m", "hf_accel.attention.prebuild"]
    assert json.loads(cmd[cmd.index("--spec") + 1]) == prebuild.spec_to_dict(SPEC)
    assert launched["kw"]["start_new_session"] is True
    assert prebuild.build_in_progress(marker)
    assert prebuild.start_background_build("flashinfer", SPEC, CUDA, marker) is None  # one builder at a time
    marker.with_suffix(".building").unlink()
    marker.with_suffix(".failed").write_text("RuntimeError: nvcc missing")
    assert prebuild.start_background_build("flashinfer", SPEC, CUDA, marker) is None  # failed before: not again
    marker.with_suffix(".failed").unlink()
    monkeypatch.setenv(prebuild.ENV_DISABLE, "0")
    assert prebuild.start_background_build("flashinfer", SPEC, CUDA, marker) is None


def test_spec_round_trips_through_the_command_line():
    spec = AttentionSpec(num_heads=8, num_kv_heads=2, head_dim=80, dtype=torch.float16, uses_softcap=True,
                         uses_sliding_window=True)
    assert prebuild.spec_from_dict(json.loads(json.dumps(prebuild.spec_to_dict(spec)))) == spec


def test_flashinfer_readiness_follows_its_workspace(tmp_path, monkeypatch):
    from hf_accel.attention.flashinfer_backend import FlashInferBackend

    monkeypatch.setenv("FLASHINFER_WORKSPACE_BASE", str(tmp_path))
    assert FlashInferBackend.library_cache_dir() == str(tmp_path / ".cache" / "flashinfer")
    if not FlashInferBackend.has_prebuilt_kernels():
        assert FlashInferBackend.pending_build(SPEC, CUDA, str(tmp_path / "c"))


def test_progress_logs_each_phase_and_keeps_the_split(caplog):
    p = StartupProgress(total_phases=3, enabled=False)
    with caplog.at_level(logging.INFO, logger="hf_accel"):
        p.phase("compile", "details")
        p.phase("capture CUDA graphs")
        p.close()
    text = caplog.text
    assert "hf_accel: compile (details)..." in text and "compile done in" in text
    assert "capture CUDA graphs done in" in text
    assert set(p.times) == {"compile", "capture CUDA graphs"}


def test_cpu_accelerate_reports_phases(caplog):
    from conftest import make_llama

    from hf_accel import accelerate_model, engine_info, restore

    model = make_llama()
    with caplog.at_level(logging.INFO, logger="hf_accel"):
        accelerate_model(model)
    try:
        startup = engine_info(model)["startup"]
        assert "allocate the KV cache" in startup["phases"]
        assert "hf_accel: allocate the KV cache" in caplog.text
    finally:
        restore(model)


def test_builder_failure_is_recorded_and_unlocks(tmp_path):
    marker = tmp_path / "builds" / "nope-abc.json"
    marker.parent.mkdir(parents=True)
    marker.with_suffix(".building").write_text("1")
    rc = prebuild.main(["--backend", "no_such_backend", "--spec", json.dumps(prebuild.spec_to_dict(SPEC)),
                        "--device", "cpu", "--marker", str(marker)])
    assert rc == 1
    assert marker.with_suffix(".failed").exists() and not marker.with_suffix(".building").exists()
    assert not prebuild.is_built(marker)


def test_static_auto_respects_the_users_block_size(world):
    big = _fake_backend("big")
    big.supported_block_sizes = (256,)
    world.classes["big"] = big
    world.names[:] = ["jitlib", "big", "ready"]
    world.cfg.block_size = 16
    assert api._static_auto_choice(world.classes["jitlib"], world.cfg, SPEC, CUDA).name == "ready"


def test_disabled_disk_cache_means_no_marker_no_build_and_no_jit_choice(world):
    world.cfg.compile_cache_dir = ""
    cls = world.classes["jitlib"]
    assert cls.build_marker(SPEC, CUDA, "") is None
    assert "cannot tell" in cls.pending_build(SPEC, CUDA, "")
    chosen, info = _choose(world)
    assert chosen.name != "jitlib" and world.started == []


def test_an_unwritable_builds_directory_never_fails_a_start(tmp_path, monkeypatch):
    monkeypatch.delenv(prebuild.ENV_DISABLE, raising=False)
    blocker = tmp_path / "file"
    blocker.write_text("")
    marker = blocker / "builds" / "flashinfer-x.json"  # a directory below a file: cannot be created
    assert prebuild.start_background_build("flashinfer", SPEC, CUDA, marker) is None


def test_the_builder_lock_is_taken_once(tmp_path, monkeypatch):
    lock = tmp_path / "flashinfer-x.building"
    assert prebuild._take_lock(lock) is True
    assert prebuild._take_lock(lock) is False  # held (this live process's pid, just written)
    lock.write_text("999999999")  # a builder that is gone
    import os as _os

    _os.utime(lock, (0, 0))  # and old
    assert prebuild._take_lock(lock) is True


def test_a_stale_lock_is_taken_over_by_one_process_only(tmp_path):
    lock = tmp_path / "flashinfer-y.building"
    lock.write_text("999999999")  # its builder is gone
    os.utime(lock, (0, 0))
    assert prebuild._take_lock(lock) is True
    assert prebuild._take_lock(lock) is False  # the first taker holds it now
    assert not list(tmp_path.glob("*.stale*"))  # the renamed stale lock was removed
