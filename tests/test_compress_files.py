"""compress="lossless" keeps a compressed layer's uncompressed weights in a file (option
``uncompressed_weights``, fx_offload.runtime.memory.file_backed): host memory holds only the
compressed copies, the parameters view the file, and every guarantee on the weights holds."""
import copy
import io
import logging
import os

import pytest
import torch

import fx_offload
from fx_offload import registry
from fx_offload.errors import OffloadError
from fx_offload.runtime.memory import file_backed
from fx_offload.tools import models
from helpers import bf16_decoder

OPTIONS = {"inner_backend": "aot_eager", "compress": "lossless", "copy_chunks": 3}


def _mappings_in(folder):
    """(size kB, resident kB) of each mapping of a file in ``folder`` (/proc/self/smaps)."""
    found, current = [], None
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5 and ":" in fields[3]:     # a mapping
                current = None
                if len(fields) >= 6 and fields[5].startswith(str(folder) + "/"):
                    current = [0, 0]
                    found.append(current)
            elif current is not None and fields[0] == "Size:":
                current[0] = int(fields[1])
            elif current is not None and fields[0] == "Rss:":
                current[1] = int(fields[1])
    return found


def _offloaded(folder, **extra):
    torch._dynamo.reset()       # a new model of a class compiled before: compiled anew
    model, inputs = bf16_decoder()
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="prefetch_offload",
                             options={**OPTIONS, "uncompressed_weights": str(folder), **extra})
    return model, reference, compiled, inputs


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="reads Linux's smaps")
def test_uncompressed_weights_live_in_files_and_take_no_memory(tmp_path):
    model, reference, compiled, inputs = _offloaded(tmp_path)
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(compiled(*inputs), reference(*inputs))
    rep = fx_offload.report(model)
    assert rep.uncompressed_in_file_bytes == rep.offloaded_bytes > 0
    assert "in files" in str(rep)
    # one unnamed file per offloaded layer, mapped whole, none of it in memory: the calls
    # read only the compressed copies
    maps = _mappings_in(tmp_path)
    assert len(maps) == len(rep.layers)
    assert sum(size for size, _ in maps) * 1024 >= rep.uncompressed_in_file_bytes
    assert all(resident == 0 for _, resident in maps), maps
    assert os.listdir(tmp_path) == []       # nothing left on disk, however the process ends
    # reading the weights reads the files
    want = reference.state_dict()
    assert all(torch.equal(v, want[k]) for k, v in model.state_dict().items())
    assert any(resident > 0 for _, resident in _mappings_in(tmp_path))


def test_what_users_do_to_weights_kept_in_files(tmp_path):
    model, reference, compiled, inputs = _offloaded(tmp_path)
    first = reference.state_dict()

    def scaled(layer, factor):
        return {k: v * factor for k, v in first.items() if k.startswith(f"layers.{layer}.")}
    with torch.no_grad():
        compiled(*inputs)
        assert fx_offload.report(model).uncompressed_in_file_bytes > 0
        sub = model.layers[1].state_dict()
        assert all(torch.equal(v, first[f"layers.1.{k}"]) for k, v in sub.items())
        assert all(torch.equal(v, first[k]) for k, v in fx_offload.named_weights(model))
        steps = [
            (lambda m: fx_offload.update_weights(m, scaled(1, 1.5)),
             lambda m: m.load_state_dict(scaled(1, 1.5), strict=False)),
            (lambda m: m.load_state_dict(scaled(3, -0.5), strict=False),) * 2,
            (lambda m: next(m.layers[5].parameters()).mul_(2),) * 2,
            # spans more octaves than the record kept room for: copied raw from the file
            # (34 decades, so that no output overflows: NaNs would make the runs unequal)
            (lambda m: next(m.layers[3].parameters()).mul_(torch.logspace(
                -30, 4, next(m.layers[3].parameters()).numel()).reshape(
                next(m.layers[3].parameters()).shape).bfloat16()),) * 2,
        ]
        for on_model, on_reference in steps:
            on_model(model)
            on_reference(reference)
            got = compiled(*inputs)
            assert torch.isfinite(got).all() and torch.equal(got, reference(*inputs))
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    buffer.seek(0)
    saved = torch.load(buffer)
    twin = copy.deepcopy(model)
    want = reference.state_dict()
    for got in (saved, twin.state_dict(), model.state_dict()):
        assert all(torch.equal(v, want[k]) for k, v in got.items())
    fx_offload.restore(model)
    assert all(torch.equal(v, want[k]) for k, v in model.state_dict().items())
    assert registry.state_for_model(model) is None


def test_no_room_or_a_failed_write_keeps_the_weights_in_memory(tmp_path, monkeypatch, caplog):
    """No room in the folder, or a write that fails at the second layer (the first one
    already in a file): the rest stay in host memory, with one warning saying why."""
    monkeypatch.setattr(file_backed, "room_in", lambda folder, n: False)
    model, reference, compiled, inputs = _offloaded(tmp_path)
    with caplog.at_level(logging.WARNING, logger="fx_offload"), torch.no_grad():
        assert torch.equal(compiled(*inputs), reference(*inputs))
    assert "has no room for the uncompressed weights" in caplog.text
    assert fx_offload.report(model).uncompressed_in_file_bytes == 0
    fx_offload.restore(model)
    monkeypatch.undo()
    caplog.clear()

    real, written = os.posix_fallocate, []

    def fails_after_one(fd, offset, n):
        if written:
            raise OSError(28, "No space left on device")
        written.append(n)
        real(fd, offset, n)
    monkeypatch.setattr(os, "posix_fallocate", fails_after_one)
    model, reference, compiled, inputs = _offloaded(tmp_path)
    with caplog.at_level(logging.WARNING, logger="fx_offload"), torch.no_grad():
        for _ in range(2):
            assert torch.equal(compiled(*inputs), reference(*inputs))
    assert "writing them to" in caplog.text and "No space left" in caplog.text
    rep = fx_offload.report(model)
    assert 0 < rep.uncompressed_in_file_bytes < rep.offloaded_bytes
    want = reference.state_dict()
    assert all(torch.equal(v, want[k]) for k, v in model.state_dict().items())


def test_auto_keeps_them_in_memory_where_the_temporary_folder_is_memory(monkeypatch, caplog):
    monkeypatch.setattr(file_backed, "filesystem_of", lambda folder: "tmpfs")
    model, inputs = bf16_decoder()
    compiled = torch.compile(model, backend="prefetch_offload", options=OPTIONS)
    with caplog.at_level(logging.INFO, logger="fx_offload"), torch.no_grad():
        compiled(*inputs)
    assert "stay in host memory" in caplog.text and "tmpfs" in caplog.text
    assert fx_offload.report(model).uncompressed_in_file_bytes == 0


def test_memory_keeps_them_in_memory_and_experts_stay_there(tmp_path):
    model, reference, compiled, inputs = _offloaded(tmp_path, uncompressed_weights="memory")
    with torch.no_grad():
        assert torch.equal(compiled(*inputs), reference(*inputs))
    assert fx_offload.report(model).uncompressed_in_file_bytes == 0
    assert _mappings_in(tmp_path) == [] if os.path.exists("/proc/self/smaps") else True
    # an MoE layer's expert rows are gathered from its host block: it stays in memory
    torch._dynamo.reset()
    moe, (x,) = models.build("moe", num_layers=4, routed=True, seq=1, batch=1)
    moe, x = moe.to(torch.bfloat16), x.bfloat16()
    reference = copy.deepcopy(moe)
    compiled = torch.compile(moe, backend="prefetch_offload",
                             options={**OPTIONS, "uncompressed_weights": str(tmp_path)})
    with torch.no_grad():
        for i in range(3):
            assert torch.equal(compiled(x.roll(i, -1)), reference(x.roll(i, -1)))
    assert registry.state_for_model(moe).routed.gathered.item() > 0
    state = registry.state_for_model(moe)
    assert state.choice.experts
    assert all(not state.buffers._blocks[layer].in_file for layer in state.choice.experts)


@pytest.mark.parametrize("value, says", [
    (123, "got 123"),
    ("", "got ''"),
    ("/no/such/folder/here", "is not a folder"),
    (__file__, "is not a folder"),
])
def test_bad_uncompressed_weights_value_is_refused(value, says):
    model, inputs = bf16_decoder(num_layers=2)
    with pytest.raises(OffloadError, match="option 'uncompressed_weights'") as info:
        fx_offload.place(model, "cpu", **OPTIONS, uncompressed_weights=value)
    assert says in str(info.value)
    assert registry.state_for_model(model) is None
    assert all(p.device.type == "cpu" for p in model.parameters())   # left as it was


def test_a_recompile_after_the_folder_is_gone_works(tmp_path):
    """The folder matters only when a file is made: once the weights are in their
    (unnamed) files, a recompile (another batch size) does not look for it."""
    folder = tmp_path / "weights"
    folder.mkdir()
    model, reference, compiled, inputs = _offloaded(folder)
    with torch.no_grad():
        assert torch.equal(compiled(*inputs), reference(*inputs))
        folder.rmdir()
        longer = torch.cat([inputs[0], inputs[0]])
        assert torch.equal(compiled(longer), reference(longer))
    assert fx_offload.report(model).uncompressed_in_file_bytes > 0


def test_uncompressed_weights_without_compression_is_refused(tmp_path):
    model, inputs = bf16_decoder(num_layers=2)
    with pytest.raises(OffloadError, match="applies with compress='lossless' only"):
        fx_offload.place(model, "cpu", uncompressed_weights=str(tmp_path))
    assert registry.state_for_model(model) is None


def test_place_moves_them_to_files_before_the_first_call(tmp_path):
    torch._dynamo.reset()
    model, inputs = bf16_decoder()
    reference = copy.deepcopy(model)
    fx_offload.place(model, "cpu", **OPTIONS, uncompressed_weights=str(tmp_path))
    assert fx_offload.report(model).uncompressed_in_file_bytes > 0
    compiled = torch.compile(model, backend="prefetch_offload",
                             options={"inner_backend": "aot_eager"})
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(compiled(*inputs), reference(*inputs))


@pytest.mark.cuda
def test_weights_in_files_on_the_gpu_captured_and_eager(tmp_path):
    """On a GPU: the records page-locked, the files pageable; outputs bitwise the
    uncompressed offloaded run's, eagerly and under CUDA graphs, also after an update that
    leaves a chunk copied raw (its file pages locked in place)."""
    for mode in ("default", "reduce-overhead"):
        torch._dynamo.reset()
        # tensors of whole 512-byte units (the GPU's alignment): every chunk compresses
        model, (x,) = bf16_decoder(hidden=256, inner=512)
        model, x = model.cuda(), x.cuda()
        plain = copy.deepcopy(model)
        options = {"mode": mode, "prefetch_step": 2}
        try:
            reference = torch.compile(plain, backend="prefetch_offload", options=options)
            compiled = torch.compile(model, backend="prefetch_offload",
                                     options={**options, "compress": "lossless",
                                              "uncompressed_weights": str(tmp_path)})
            with torch.no_grad():
                for i in range(3):
                    xi = x.roll(i, 0)
                    assert torch.equal(compiled(xi).clone(), reference(xi).clone()), (mode, i)
                rep = fx_offload.report(model)
                assert rep.uncompressed_in_file_bytes == rep.offloaded_bytes, rep
                assert rep.pinned, rep      # the records the copies read
                if mode == "default":
                    for m in (model, plain):      # too many octaves for the record
                        w = max(m.layers[3].parameters(), key=torch.numel)
                        w.mul_(torch.logspace(-20, 0, w.numel(), device=w.device)
                               .reshape(w.shape).bfloat16())
                    state = registry.state_for_model(model)
                    for i in range(2):
                        assert torch.equal(compiled(x).clone(), reference(x).clone()), i
                    assert state.buffers._blocks[3].pinned
            want = plain.state_dict()
            assert all(torch.equal(v.cpu(), want[k].cpu())
                       for k, v in model.state_dict().items())
        finally:
            for m in (model, plain):
                if registry.state_for_model(m) is not None:
                    fx_offload.restore(m)


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads Linux's VmRSS")
def test_hostmem_command_shows_the_host_copy_shrink():
    """``python -m fx_offload hostmem``: with the uncompressed weights in files, the host
    keeps about their bytes less than with them in memory (measured per row in a fresh
    process); every row's outputs equal the resident model's."""
    import subprocess
    import sys
    done = subprocess.run([sys.executable, "-m", "fx_offload", "hostmem", "--device", "cpu",
                           "--layers", "4", "--hidden", "512", "--inner", "2048"],
                          capture_output=True, text=True, timeout=600, check=True)
    rows = [line.strip("| ").split(" | ") for line in done.stdout.splitlines()
            if line.startswith("| none") or line.startswith("| lossless")]
    assert len(rows) == 3 and all(r[-1] == "equal" for r in rows), done.stdout
    (_, _, offloaded, _, _, _, _), (_, _, _, _, _, in_memory, _), \
        (_, _, _, _, in_files, in_file_rows, _) = rows
    assert float(in_files) == float(offloaded) > 0
    assert float(in_memory) - float(in_file_rows) > 0.8 * float(offloaded), done.stdout


def test_dropping_the_model_frees_its_files_at_once(tmp_path):
    """The first graph, compiled while the parameters still held their own storage, ends
    by letting it go; Dynamo keeps that graph after the model is dropped, which must not
    keep the model's state (its files' mappings and their disk space) alive."""
    import gc
    import weakref
    model, reference, compiled, inputs = _offloaded(tmp_path)
    with torch.no_grad():
        assert torch.equal(compiled(*inputs), reference(*inputs))
    state_ref = weakref.ref(registry.state_for_model(model))
    if os.path.exists("/proc/self/smaps"):
        assert _mappings_in(tmp_path)
    gc.collect()
    gc.disable()            # at once: no collection needed (tests/test_ownership.py)
    try:
        del model, compiled
        assert state_ref() is None
    finally:
        gc.enable()
    if os.path.exists("/proc/self/smaps"):
        assert _mappings_in(tmp_path) == []


def test_share_memory_then_a_write_reaches_the_next_call(tmp_path, caplog):
    """``model.share_memory()`` (pickling the model for another process does the same) moves
    the parameters' storage, host blocks' views along, out of the blocks the copies read:
    the next call copies the values back, so a later in-place write is computed with."""
    model, reference, compiled, inputs = _offloaded(tmp_path)
    with torch.no_grad():
        assert torch.equal(compiled(*inputs), reference(*inputs))
        model.share_memory()
        for m in (model, reference):
            m.layers[1].mlp.up_proj.weight.mul_(3)
        with caplog.at_level(logging.INFO, logger="fx_offload"):
            for _ in range(2):
                assert torch.equal(compiled(*inputs), reference(*inputs))
    assert "moved out of their host block" in caplog.text
    want = reference.state_dict()
    assert all(torch.equal(v, want[k]) for k, v in model.state_dict().items())
