"""compress="lossless": bf16 weights cross the link as records of 12 bits a word plus escapes
(fx_offload.codecs.lossless) and are decoded into the slot; outputs stay bitwise those of the
model without offloading, and everything a user does to the weights keeps its guarantees."""
import contextlib
import copy
import io
import logging
import threading

import pytest
import torch

import fx_offload
from fx_offload import registry
from fx_offload.errors import OffloadError
from fx_offload.codecs import ans, lossless
from fx_offload.tools import models
from helpers import bf16_decoder

OPTIONS = {"inner_backend": "aot_eager", "compress": "lossless", "copy_chunks": 3}


def _words(n, seed=0, scale=0.02):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=gen) * scale).bfloat16()


def _round_trip(words):
    raw = words.view(torch.uint8)
    made = lossless.encode(raw)
    if made is None:
        return None
    record, rec = made
    out = torch.full_like(raw, 0xAB)
    lossless.decode(record, rec, out)
    assert torch.equal(out, raw)
    return rec


def test_codec_round_trips_normal_weights_at_three_quarters():
    rec = _round_trip(_words(1 << 16))
    assert 0.74 < rec.nbytes / rec.raw_nbytes < 0.76


@pytest.mark.parametrize("case", ["specials", "odd", "one", "uniform_scale", "every_exponent"])
def test_codec_is_exact_on_any_words(case):
    words = _words(4097 if case == "odd" else 3000, seed=3)
    if case == "specials":      # inf, nan, -0, subnormals, the largest finite
        words[::5] = torch.tensor([float("inf"), float("-inf"), float("nan"), -0.0, 1e-40,
                                   -3e38, 0.0]).bfloat16().repeat(1000)[:words[::5].numel()]
    elif case == "one":
        words = words[:1]
    elif case == "uniform_scale":
        words = words * torch.logspace(-30, 30, words.numel()).bfloat16()
    elif case == "every_exponent":     # all 65536 bit patterns: not worth compressing
        words = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(
            torch.bfloat16)
        assert _round_trip(words) is None
        return
    rec = _round_trip(words)
    if rec is not None:
        assert rec.nbytes <= lossless.WORTH * rec.raw_nbytes


def test_codec_refuses_a_record_that_does_not_match():
    raw = _words(4096).view(torch.uint8)
    record, rec = lossless.encode(raw)
    lossless.check(record, rec, "x")
    record[lossless.HEADER + 7] ^= 1
    with pytest.raises(OffloadError, match="corrupt"):
        lossless.check(record, rec, "x")
    with pytest.raises(OffloadError, match="does not match its chunk"):
        lossless.decode(record, rec, torch.empty(10, dtype=torch.uint8))


def test_update_needing_more_escapes_than_room_is_refused_by_encode():
    raw = _words(8192).view(torch.uint8)
    _, rec = lossless.encode(raw)
    wide = _words(8192) * torch.logspace(-30, 30, 8192).bfloat16()
    assert lossless.encode(wide.view(torch.uint8), fit=rec) is None


def test_lossless_outputs_bitwise_and_fewer_bytes_copied():
    model, inputs = bf16_decoder()
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="prefetch_offload", options=OPTIONS)
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(compiled(*inputs), reference(*inputs))
    rep = fx_offload.report(model)
    assert rep.compressed and set(rep.call_bytes) == set(rep.layers)
    for layer in rep.layers:
        assert 0.7 < rep.call_bytes[layer] / rep.layer_bytes[layer] < 0.8
    # a call copies each offloaded layer once, compressed
    assert rep.copied_bytes_last_call == sum(rep.call_bytes.values())
    assert rep.codec == "fx_offload"     # on the CPU: our codec (nvCOMP decodes on GPUs)
    assert "compressed (lossless, fx_offload codec)" in str(rep) and "ratio" in str(rep)
    assert registry.state_for_model(model).stats["sync_loads"] == 0


def test_lossless_with_inductor_equals_the_uncompressed_run():
    """Inductor's kernels for the offloaded graph (bf16 on the CPU differs from a resident
    Inductor run in rounding): the compressed run gives the uncompressed run's bits."""
    model, inputs = bf16_decoder(num_layers=4)
    plain = copy.deepcopy(model)
    outputs = []
    for m, compress in ((plain, "none"), (model, "lossless")):
        torch._dynamo.reset()
        compiled = torch.compile(m, backend="prefetch_offload",
                                 options={**OPTIONS, "inner_backend": "inductor",
                                          "compress": compress})
        with torch.no_grad():
            outputs.append(compiled(*inputs))
    assert torch.equal(*outputs)
    assert fx_offload.report(model).compressed and not fx_offload.report(plain).compressed


def test_updates_are_compressed_again():
    """update_weights, load_state_dict, an in-place write and new storage all reach the
    compressed copy: the next call computes with the new weights."""
    model, inputs = bf16_decoder()
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="prefetch_offload", options=OPTIONS)
    first = reference.state_dict()

    def scaled(layer, factor):
        return {k: v * factor for k, v in first.items() if k.startswith(f"layers.{layer}.")}
    steps = [
        (lambda m: fx_offload.update_weights(m, scaled(1, 1.5)),
         lambda m: m.load_state_dict(scaled(1, 1.5), strict=False)),
        (lambda m: m.load_state_dict(scaled(3, -0.5), strict=False),) * 2,
        (lambda m: next(m.layers[5].parameters()).mul_(2),) * 2,
        (lambda m: setattr(next(m.layers[1].parameters()), "data",
                           next(m.layers[1].parameters()).detach().clone() + 0.25),) * 2,
    ]
    with torch.no_grad():
        compiled(*inputs)
        for on_model, on_reference in steps:
            on_model(model)
            on_reference(reference)
            assert torch.equal(compiled(*inputs), reference(*inputs))
    fx_offload.restore(model)
    for (name, a), b in zip(model.state_dict().items(), reference.state_dict().values()):
        assert torch.equal(a, b), name


def test_an_update_that_does_not_fit_is_copied_raw_and_stays_right(caplog):
    model, inputs = bf16_decoder()
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="prefetch_offload", options=OPTIONS)
    with torch.no_grad():
        compiled(*inputs)
        for m in (model, reference):
            w = next(m.layers[3].parameters())
            # 34 decades: more than the record kept room for, yet no output overflows (a
            # NaN output would make any two runs unequal, right or not)
            w.copy_(w * torch.logspace(-30, 4, w.numel()).reshape(w.shape).bfloat16())
        with caplog.at_level(logging.INFO, logger="fx_offload"):
            got = compiled(*inputs)
            assert torch.isfinite(got).all() and torch.equal(got, reference(*inputs))
    assert "copied uncompressed from now on" in caplog.text
    rep = fx_offload.report(model)
    assert rep.call_bytes[3] > rep.call_bytes[1]


def test_a_corrupt_record_is_reported_not_decoded():
    model, inputs = bf16_decoder()
    compiled = torch.compile(model, backend="prefetch_offload", options=OPTIONS)
    with torch.no_grad():
        compiled(*inputs)
        state = registry.state_for_model(model)
        block = state.buffers.compressed[1].block
        block.buffer[100] ^= 0x10            # host memory flipped under the records
        with pytest.raises(OffloadError, match="compressed host copy of layer 1 .* is corrupt"):
            compiled(*inputs)
    fx_offload.restore(model)               # the weights themselves are intact
    want = bf16_decoder()[0].state_dict()
    assert all(torch.equal(a, want[k]) for k, a in model.state_dict().items())


def test_what_users_do_keeps_the_true_weights():
    model, inputs = bf16_decoder()
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="prefetch_offload", options=OPTIONS)
    with torch.no_grad():
        compiled(*inputs)
    _reads_the_true_weights(model, reference.state_dict())


def _reads_the_true_weights(model, want: dict) -> None:
    """state_dict (of the model and of layer 1), named_weights and a deepcopy's give ``want``."""
    assert all(torch.equal(v, want[k]) for k, v in model.state_dict().items())
    sub = model.layers[1].state_dict()
    assert all(torch.equal(v, want[f"layers.1.{k}"]) for k, v in sub.items())
    assert all(torch.equal(v, want[k]) for k, v in fx_offload.named_weights(model))
    twin = copy.deepcopy(model)
    assert all(torch.equal(v, want[k]) for k, v in twin.state_dict().items())


def test_torch_save_of_a_layer_of_mixed_dtypes():
    """A host block holds a layer's tensors of every dtype (bf16 weights, an fp32 norm):
    ``torch.save`` of the state dict between calls works (it refuses one storage viewed as
    several dtypes) and loads the true weights."""
    model, inputs = bf16_decoder()
    for layer in model.layers:
        layer.input_layernorm.float()
    reference = copy.deepcopy(model)
    fx_offload.place(model, "cpu", group_size=2, num_in_group=1, compress="lossless")
    assert registry.state_for_model(model).buffers.compressed
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    buffer.seek(0)
    saved = torch.load(buffer)
    want = reference.state_dict()
    assert saved.keys() == want.keys()
    assert all(v.dtype == want[k].dtype and torch.equal(v, want[k]) for k, v in saved.items())
    assert saved["layers.1.input_layernorm.weight"].dtype == torch.float32


def test_a_model_with_nothing_to_compress_says_so(caplog):
    model, inputs = models.build("decoder")          # float32: nothing to compress
    reference = copy.deepcopy(model)
    with caplog.at_level(logging.INFO, logger="fx_offload"):
        compiled = torch.compile(model, backend="prefetch_offload", options=OPTIONS)
        with torch.no_grad():
            assert torch.equal(compiled(*inputs), reference(*inputs))
    assert "compress='lossless' compresses bfloat16 weights only" in caplog.text
    rep = fx_offload.report(model)
    # nothing encoded: each copy moves the whole layer (with its alignment padding)
    assert all(rep.call_bytes[layer] >= rep.layer_bytes[layer] for layer in rep.layers)


@pytest.mark.parametrize("value", ["zstd", 1, True, "LOSSLESS"])
def test_bad_compress_value_is_refused(value):
    model, inputs = bf16_decoder()
    compiled = torch.compile(model, backend="prefetch_offload", options={"compress": value})
    with pytest.raises(Exception, match="option 'compress' must be one of"):
        with torch.no_grad():
            compiled(*inputs)


@pytest.mark.cuda
def test_lossless_on_the_gpu_captured_and_eager(monkeypatch):
    """Triton decode on the decode stream, synchronous loads on the compute stream, and a
    reduce-overhead capture: outputs bitwise the uncompressed offloaded run's.  Our codec
    (where nvCOMP is installed its ANS would be the default: the next test covers both)."""
    monkeypatch.setenv("FX_OFFLOAD_LOSSLESS_CODEC", "fx_offload")
    for mode in ("default", "reduce-overhead"):
        model, (x,) = bf16_decoder()
        x = x.cuda()
        with _on_the_gpu(model, mode) as (compiled, reference, model, _):
            with torch.no_grad():
                for i in range(4):
                    xi = x.roll(i, 0)
                    assert torch.equal(compiled(xi).clone(), reference(xi).clone()), (mode, i)
            rep = fx_offload.report(model)
            assert registry.state_for_model(model).buffers.staging is not None
            assert registry.state_for_model(model).stats["sync_loads"] == 0
            # small tensors at multiples of 512 bytes: less to gain than a large layer's 0.75
            assert all(rep.call_bytes[i] < rep.layer_bytes[i] for i in rep.layers), rep


@contextlib.contextmanager
def _on_the_gpu(model, mode: str):
    """(compiled, reference, model, plain): ``model`` moved to the GPU and compiled with
    compress='lossless', a copy of it compiled without; both restored after the block, so a
    failure leaves no offloaded model behind for the next test."""
    torch._dynamo.reset()
    model = model.cuda()
    plain = copy.deepcopy(model)
    try:
        reference = torch.compile(plain, backend="prefetch_offload",
                                  options={"mode": mode, "prefetch_step": 2})
        compiled = torch.compile(model, backend="prefetch_offload",
                                 options={"compress": "lossless", "prefetch_step": 2,
                                          "mode": mode})
        yield compiled, reference, model, plain
    finally:
        for m in (model, plain):
            if registry.state_for_model(m) is not None:
                fx_offload.restore(m)


@pytest.mark.cuda
@pytest.mark.parametrize("codec", ["nvcomp", "fx_offload"])
def test_each_gpu_codec_captured_eager_and_after_new_weights(codec, monkeypatch):
    """nvCOMP's ANS records (where nvCOMP is installed: the default codec there) and ours,
    chosen by FX_OFFLOAD_LOSSLESS_CODEC: outputs bitwise the uncompressed offloaded run's,
    eagerly and replayed from a CUDA graph, also after new weights of the same kind are
    encoded into the records the graph captured."""
    for mode in ("default", "reduce-overhead"):
        model, x = _drawn_decoder(codec, monkeypatch)
        with _on_the_gpu(model, mode) as (compiled, reference, model, plain):
            with torch.no_grad():
                for i in range(6):
                    if i == 3:      # new weights, the same in both (drawn alike: they fit)
                        stats = registry.state_for_model(model).stats
                        assert stats["sync_loads"] == 0     # (new weights are reloaded)
                        for m in (model, plain):
                            torch.manual_seed(1)
                            for p in m.parameters():
                                p.normal_(0, 0.02)
                    xi = x.roll(i, 0)
                    assert torch.equal(compiled(xi).clone(), reference(xi).clone()), (mode, i)
            rep = fx_offload.report(model)
            assert rep.codec == ("nvCOMP ANS" if codec == "nvcomp" else "fx_offload"), rep
            ratio = sum(rep.call_bytes.values()) / sum(rep.layer_bytes.values())
            # tensors this small pay their sections' alignment (ours) or tables (nvCOMP's)
            assert ratio < (0.71 if codec == "nvcomp" else 0.8), rep


def _drawn_decoder(codec: str, monkeypatch):
    """(model, input on the GPU): the tiny decoder at hidden 512 with weights drawn normal(0,
    0.02), as trained ones are, and ``codec`` chosen (skipped where nvCOMP is missing)."""
    if codec == "nvcomp" and ans._library() is None:
        pytest.skip("nvCOMP's library (nvidia-libnvcomp-cu13) is not installed")
    monkeypatch.setenv("FX_OFFLOAD_LOSSLESS_CODEC", codec)
    model, (x,) = bf16_decoder(hidden=512, inner=2048)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    return model, x.cuda()


@pytest.mark.cuda
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
@pytest.mark.parametrize("codec", ["nvcomp", "fx_offload"])
def test_a_record_corrupted_in_host_memory_is_caught_on_the_gpu(codec, mode, monkeypatch):
    """A byte of each record flipped in host memory after the records were made (and, under
    reduce-overhead, captured): the call that copies them computes with NaN in their place,
    never with wrong weights; every later call raises, naming them; new weights for those
    layers (update_weights) encode the records anew and the model is right again."""
    model, x = _drawn_decoder(codec, monkeypatch)
    with _on_the_gpu(model, mode) as (compiled, reference, model, plain):
        with torch.no_grad():
            for i in range(3):
                assert torch.equal(compiled(x).clone(), reference(x).clone()), i
            torch.cuda.synchronize()        # the last call's copies, of intact records
            buffers = registry.state_for_model(model).buffers
            # the last offloaded layer: copied in the middle of each call (a slot's first
            # layer is copied at a call's entry, where its check may already raise)
            flipped = [max(buffers.compressed)]
            packed = buffers.compressed[flipped[0]]
            for c in buffers.layout[flipped[0]]:
                if packed.holds(c):
                    record = packed.record_of(c)
                    record[record.numel() // 2] ^= 0x10
            out = compiled(x).clone()
            torch.cuda.synchronize()
            assert torch.isnan(out).any(), "a corrupt record was decoded into weights"
            for _ in range(2):
                with pytest.raises(OffloadError, match=rf"layer {flipped[0]} of TinyDecoder "
                                   r"\(chunks? \d.* is corrupt .*verified on the GPU"):
                    compiled(x)
            names = {n for n, _ in model.named_parameters()
                     if any(n.startswith(f"layers.{layer}.") for layer in flipped)}
            fx_offload.update_weights(
                model, {n: t.clone() for n, t in plain.state_dict().items() if n in names})
            for i in range(3):
                assert torch.equal(compiled(x.roll(i, 0)).clone(),
                                   reference(x.roll(i, 0)).clone()), i
        want = plain.state_dict()
        assert all(torch.equal(v, want[k]) for k, v in model.state_dict().items())


@pytest.mark.cuda
@pytest.mark.parametrize("codec", ["nvcomp", "fx_offload"])
def test_what_users_do_on_the_gpu_with_each_codec(codec, monkeypatch):
    """On a GPU, with each codec: state_dict (of the model and of a layer), named_weights and
    deepcopy give the true weights; calls from two threads at once and load_state_dict of new
    weights between calls give the outputs of the model without compression, bitwise."""
    model, x = _drawn_decoder(codec, monkeypatch)
    with _on_the_gpu(model, "default") as (compiled, reference, model, plain):
        with torch.no_grad():
            assert torch.equal(compiled(x), reference(x))
        want = plain.state_dict()
        _reads_the_true_weights(model, want)
        outs, errors = {}, []

        def calls(i: int) -> None:
            try:
                with torch.no_grad():
                    outs[i] = [compiled(x.roll(i, 0)).clone() for _ in range(3)]
                torch.cuda.synchronize()
            except Exception as error:      # reported by the main thread
                errors.append(error)
        threads = [threading.Thread(target=calls, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        with torch.no_grad():
            for i in range(2):
                expected = reference(x.roll(i, 0))
                assert all(torch.equal(out, expected) for out in outs[i]), i
            torch.manual_seed(3)
            new = {k: torch.randn_like(v) * 0.02 for k, v in want.items()}
            model.load_state_dict(new)
            plain.load_state_dict(new)
            for i in range(3):
                assert torch.equal(compiled(x.roll(i, 0)), reference(x.roll(i, 0))), i
        assert all(torch.equal(v, new[k]) for k, v in model.state_dict().items())


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("codec", ["nvcomp", "fx_offload"])
def test_a_model_on_the_second_gpu_decodes_there(codec, monkeypatch):
    """Both codecs launch their decode kernels on the current device: a model on cuda:1
    while the current device is cuda:0 decodes on cuda:1, bitwise."""
    if codec == "nvcomp" and ans._library() is None:
        pytest.skip("nvCOMP's library (nvidia-libnvcomp-cu13) is not installed")
    monkeypatch.setenv("FX_OFFLOAD_LOSSLESS_CODEC", codec)
    torch.cuda.set_device(0)
    model, (x,) = bf16_decoder(hidden=512, inner=2048)
    model, x = model.to("cuda:1"), x.to("cuda:1")
    plain = copy.deepcopy(model)
    try:
        reference = torch.compile(plain, backend="prefetch_offload",
                                  options={"prefetch_step": 2})
        compiled = torch.compile(model, backend="prefetch_offload",
                                 options={"compress": "lossless", "prefetch_step": 2})
        with torch.no_grad():
            for i in range(3):
                assert torch.equal(compiled(x.roll(i, 0)), reference(x.roll(i, 0))), i
        assert fx_offload.report(model).call_bytes
        assert torch.cuda.current_device() == 0
    finally:
        for m in (model, plain):
            if registry.state_for_model(m) is not None:
                fx_offload.restore(m)


def test_the_codec_variable_is_checked(monkeypatch):
    """FX_OFFLOAD_LOSSLESS_CODEC: a bad value, or 'nvcomp' where nvCOMP's library does not
    load, is refused with what to do; 'fx_offload', and any value on the CPU, take ours."""
    model, inputs = bf16_decoder()
    reference = copy.deepcopy(model)
    monkeypatch.setenv("FX_OFFLOAD_LOSSLESS_CODEC", "zstd")
    compiled = torch.compile(model, backend="prefetch_offload", options=OPTIONS)
    with pytest.raises(Exception, match="FX_OFFLOAD_LOSSLESS_CODEC='zstd' chooses the codec"):
        with torch.no_grad():
            compiled(*inputs)
    monkeypatch.delenv("FX_OFFLOAD_LOSSLESS_CODEC")     # the weights are intact: it runs
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="prefetch_offload", options=OPTIONS)
    with torch.no_grad():
        assert torch.equal(compiled(*inputs), reference(*inputs))
        assert torch.equal(model(*inputs), reference(*inputs))
    assert fx_offload.report(model).codec == "fx_offload"
    monkeypatch.setenv("FX_OFFLOAD_LOSSLESS_CODEC", "nvcomp")
    assert not ans.available(torch.device("cpu"))      # nvCOMP decodes on GPUs only
    monkeypatch.setattr(ans, "_library", lambda: None)
    with pytest.raises(OffloadError, match="pip install nvidia-libnvcomp-cu13"):
        ans.available(torch.device("cuda"))
    monkeypatch.setenv("FX_OFFLOAD_LOSSLESS_CODEC", "fx_offload")
    assert not ans.available(torch.device("cuda"))
    monkeypatch.delenv("FX_OFFLOAD_LOSSLESS_CODEC")
    assert not ans.available(torch.device("cuda"))      # auto, without nvCOMP: ours


def test_ratio_command_trains_and_reports_each_codec(capsys):
    """``python -m fx_offload ratio``: the decoder learns (its loss falls) and the table gives
    our records' ratio and the exponent bound for drawn, initial and trained weights."""
    from fx_offload.tools import cli
    assert cli.main(["ratio", "--layers", "1", "--hidden", "64", "--inner", "128",
                     "--steps", "30", "--seq", "16", "--batch", "8"]) == 0
    out = capsys.readouterr().out
    losses = [float(line.split("loss")[1]) for line in out.splitlines() if "loss" in line]
    assert losses[-1] < losses[0] - 0.3, out
    rows = {line[:36].strip(): line[36:].split() for line in out.splitlines()
            if line.startswith(("drawn", "initial", "trained"))}
    assert len(rows) == 3, out
    for ours, nv, bound in rows.values():
        assert 0.7 < float(ours) < 0.8 and 0.6 < float(bound) < float(ours), out
