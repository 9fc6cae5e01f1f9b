"""flashgen.integrations.transformers: tiny random Llama, Mistral (sliding window shorter
than the sequence), Gemma 2 (attention soft-capping) and gpt-oss (learnable attention
sinks, sliding and full layers) models, float32, training mode without dropout: logits,
loss and every parameter's gradient through flashgen match transformers' own
implementation (sdpa; eager for Gemma 2's softcap and gpt-oss's sinks, which sdpa lacks),
with and without a padding mask (gpt-oss with padding: its bool mask read by a
mask_mod); the mask function; the fallbacks and their reasons.

CPU tensors run flashgen's Triton kernels in the interpreter (conftest sets
TRITON_INTERPRET=1; float32 takes the kernels, flashgen.library.use_kernels)."""

import copy
import warnings

import pytest
import torch

import transformers  # flashgen's test extra (never skipped: a missing install is an error)

import flashgen
from flashgen import api, documents
from flashgen.integrations import transformers as fg_tf

SEQ = 24
NAME = fg_tf.register()


def _llama():
    return transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


def _mistral():
    return transformers.MistralConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      max_position_embeddings=64, sliding_window=7)


def _gemma2():
    return transformers.Gemma2Config(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                     query_pre_attn_scalar=16, max_position_embeddings=64, sliding_window=9,
                                     attn_logit_softcapping=5.0, final_logit_softcapping=None,
                                     layer_types=["sliding_attention", "full_attention"])


def _gpt_oss():
    # sinks on every layer; layer 0 slides (window 7 < SEQ), layer 1 is global; 4 experts, top 2
    return transformers.GptOssConfig(vocab_size=96, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                                     num_experts_per_tok=2, max_position_embeddings=64, sliding_window=7,
                                     layer_types=["sliding_attention", "full_attention"],
                                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


CONFIGS = {"llama": (_llama, "sdpa"), "mistral": (_mistral, "sdpa"), "gemma2": (_gemma2, "eager"),
           "gpt_oss": (_gpt_oss, "eager")}


def _pair(make, reference):
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(make(), attn_implementation=reference)
    got = transformers.AutoModelForCausalLM.from_config(make(), attn_implementation=NAME)
    got.load_state_dict(ref.state_dict())
    assert ref.config._attn_implementation == reference and got.config._attn_implementation == NAME
    return ref, got


def _step(model, ids, mask):
    """Logits, loss and parameter gradients of one training step (no optimizer).  The
    loss leaves out every label predicted from a padded position (label -100 where the
    position or the one before it is padding): a left-padded query row sees no key,
    and there eager averages the masked scores while flashgen (and sdpa) give 0."""
    model.train()
    model.zero_grad(set_to_none=True)
    labels = ids
    if mask is not None:
        prev = torch.cat([mask[:, :1], mask[:, :-1]], dim=1)
        labels = ids.masked_fill((mask == 0) | (prev == 0), -100)
    out = model(input_ids=ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    return out.logits.detach(), out.loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.fixture(autouse=True)
def fresh_window_record(monkeypatch):
    """Every test starts with no model seen passing its sliding window (the record is
    per config class and would otherwise depend on the tests that ran before)."""
    monkeypatch.setattr(fg_tf, "_PASSES_WINDOW", {})


@pytest.fixture
def calls(monkeypatch):
    """The keyword arguments of every flashgen.attention call the integration makes."""
    seen = []
    real = api.attention

    def spy(q, k, v, **kw):
        seen.append(dict(kw, shapes=(tuple(q.shape), tuple(k.shape))))
        return real(q, k, v, **kw)

    monkeypatch.setattr(api, "attention", spy)
    return seen


@pytest.mark.parametrize("padded", [False, True], ids=["no-mask", "padding"])
@pytest.mark.parametrize("arch", list(CONFIGS))
def test_training_step_matches_transformers(arch, padded, calls):
    make, reference = CONFIGS[arch]
    ref, got = _pair(make, reference)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 96, (2, SEQ), generator=g)
    mask = None
    if padded:
        mask = torch.ones(2, SEQ, dtype=torch.long)
        mask[1, :5] = 0  # left padding of entry 1
        mask[0, -3:] = 0  # right padding of entry 0
    layers = make().num_hidden_layers
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="flashgen:")  # no fallback
        l_ref, loss_ref, g_ref = _step(ref, ids, mask)
        # the first forward: a sliding-window mask is kept until the model's layers were
        # seen passing their window (fg_tf._PASSES_WINDOW), and read exactly
        l_first, _, _ = _step(got, ids, mask)
        calls.clear()
        l_got, loss_got, g_got = _step(got, ids, mask)
    valid = torch.ones(2, SEQ, dtype=torch.bool) if mask is None else mask.bool()
    torch.testing.assert_close(l_first[valid], l_ref[valid], rtol=1e-4, atol=2e-5)
    assert len(calls) == layers  # every layer's forward ran flashgen
    if not padded:
        assert all(c.get("bias") is None and c["causal"] for c in calls)
        if arch == "gpt_oss":  # both masks dropped (window= on the sliding layer); each layer's own sinks
            assert [c["window"] for c in calls] == [(6, 0), (-1, -1)]
            sinks = [got.model.layers[i].self_attn.sinks for i in range(layers)]
            assert all(c["sinks"].dtype == torch.float32 and c["sinks"] is s for c, s in zip(calls, sinks))
            # the sinks' gradients (compared below with the rest) are well above the tolerance
            assert all(g_ref[f"model.layers.{i}.self_attn.sinks"].abs().max() > 5e-4 for i in range(layers))
        if arch == "mistral":  # the sliding-window mask was dropped for window=
            assert [c["window"] for c in calls] == [(6, 0)] * layers
        if arch == "gemma2":  # layer 0 slides, layer 1 is global; both soft-capped
            assert [c["window"] for c in calls] == [(8, 0), (-1, -1)]
            assert all(c["softcap"] == 5.0 for c in calls)
    elif arch == "gpt_oss":  # causal, the window, and the key padding through a mask_mod; each layer's sinks
        assert all(c.get("bias") is None and c["mask_mod"] is not None and c["causal"] for c in calls)
        assert [c["window"] for c in calls] == [(6, 0), (-1, -1)]
        assert all(c["sinks"] is not None for c in calls)
    else:
        assert all(c["bias"] is not None and c["bias"].dtype == torch.bool and not c["causal"] for c in calls)
    torch.testing.assert_close(l_got[valid], l_ref[valid], rtol=1e-4, atol=2e-5)
    torch.testing.assert_close(loss_got, loss_ref, rtol=1e-5, atol=1e-6)
    assert g_got.keys() == g_ref.keys()
    for n in g_ref:
        torch.testing.assert_close(g_got[n], g_ref[n], rtol=1e-4, atol=2e-5, msg=lambda m: f"{n}: {m}")


@pytest.mark.parametrize("arch", ["phimoe", "qwen2_moe"])
def test_a_model_that_never_passes_its_window_keeps_the_windows_mask(arch, calls):
    """Phimoe (every layer slides) and Qwen2-MoE (sliding layers) build a sliding-window
    mask but never pass ``sliding_window`` to the attention function: their mask is never
    dropped (that would attend to every earlier key), in the first forward or later
    ones, and the logits match sdpa's."""
    common = dict(vocab_size=96, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, sliding_window=6)
    if arch == "phimoe":
        def make():
            return transformers.PhimoeConfig(**common, num_local_experts=2, num_experts_per_tok=1)
    else:
        def make():
            return transformers.Qwen2MoeConfig(**common, num_experts=2, num_experts_per_tok=1, moe_intermediate_size=32,
                                               shared_expert_intermediate_size=32, use_sliding_window=True,
                                               max_window_layers=2,
                                               layer_types=["sliding_attention", "sliding_attention"])
    ref, got = _pair(make, "sdpa")
    ids = torch.randint(0, 96, (2, SEQ), generator=torch.Generator().manual_seed(1))
    ref.eval()
    got.eval()
    with torch.no_grad():
        want = ref(input_ids=ids).logits
        cfg = make()  # the same model attending to every earlier key
        if arch == "phimoe":
            cfg.sliding_window = None
        else:
            cfg.layer_types = ["full_attention"] * cfg.num_hidden_layers
        full = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
        full.load_state_dict(ref.state_dict())
        full.eval()
        assert (full(input_ids=ids).logits - want).abs().max() > 1e-2  # the window matters at this length
        for _ in range(2):
            calls.clear()
            torch.testing.assert_close(got(input_ids=ids).logits, want, rtol=1e-4, atol=2e-5)
            assert len(calls) == 2 and all(c["bias"] is not None and c["window"] == (-1, -1) for c in calls), calls
    assert not fg_tf._window_passed(got.config) and fg_tf._PASSES_WINDOW[id(got.config)][0]() is got.config


def test_a_decode_step_over_a_cache_runs_the_flash_decoding_form(calls, monkeypatch):
    """Generation through transformers' cache: after a prefill of 520 tokens, one decode
    step gives flashgen.attention one query per head over 521 keys, which it runs in its
    flash-decoding form (the decode kernel, library.decode_form); the step's logits match
    the sdpa model's."""
    from flashgen.families.triton import launch

    decoded = []
    real = launch._fwd_decode_form
    monkeypatch.setattr(launch, "_fwd_decode_form", lambda *a, **kw: decoded.append(a[0].shape) or real(*a, **kw))
    tokens = flashgen.library.DECODE_FORM_RULES[0][1] + 8

    def make():
        cfg = _llama()
        cfg.max_position_embeddings = tokens + 8
        return cfg

    ref, got = _pair(make, "sdpa")
    ids = torch.randint(0, 96, (2, tokens), generator=torch.Generator().manual_seed(5))
    logits = {}
    for name, model in (("ref", ref), ("got", got)):
        model.eval()
        with torch.no_grad():
            cache = transformers.DynamicCache(config=model.config)
            out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
            nxt = out.logits[:, -1:].argmax(-1)
            logits[name] = model(input_ids=nxt, past_key_values=cache, use_cache=True).logits
    layers = make().num_hidden_layers
    assert [c["shapes"] for c in calls[-layers:]] == [((2, 4, 1, 16), (2, 2, tokens + 1, 16))] * layers
    assert decoded == [(2, 4, 1, 16)] * layers  # the decode step's layers; the prefill's took the forward
    torch.testing.assert_close(logits["got"], logits["ref"], rtol=1e-4, atol=2e-5)


@pytest.fixture
def varlen_calls(monkeypatch):
    """(cu_seqlens, max_seqlen, keywords) of every flashgen.attention_varlen call the
    integration makes."""
    seen = []
    real = api.attention_varlen

    def spy(q, k, v, cu_q, cu_k, max_q, max_k, **kw):
        seen.append((cu_q.tolist(), max_q, kw))
        return real(q, k, v, cu_q, cu_k, max_q, max_k, **kw)

    monkeypatch.setattr(api, "attention_varlen", spy)
    return seen


def _packed_positions(rows: list[list[int]]) -> torch.Tensor:
    return torch.stack([torch.cat([torch.arange(n) for n in row]) for row in rows])


@pytest.mark.parametrize("arch", ["llama", "mistral", "gemma2"])
def test_packed_sequences_match_transformers(arch, calls, varlen_calls):
    """Padding-free packing (position_ids restarting at each document, no cache):
    transformers builds a block-diagonal mask; flashgen runs the documents as one ragged
    batch (no mask read), except with a softcap (Gemma 2), which the ragged-batch
    kernels lack: there the mask is read as a bias."""
    make, reference = CONFIGS[arch]
    ref, got = _pair(make, reference)
    rows = [[5, 9, 1, 9], [11, 13]]  # 24 tokens each; Mistral's window 7 is shorter than three documents
    pos = _packed_positions(rows)
    ids = torch.randint(0, 96, (2, SEQ), generator=torch.Generator().manual_seed(2))
    outs = []
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="flashgen:")  # no fallback
        for model in (ref, got):
            model.train()
            model.zero_grad(set_to_none=True)
            out = model(input_ids=ids, position_ids=pos, labels=ids, use_cache=False)
            out.loss.backward()
            outs.append((out.logits.detach(), {n: p.grad for n, p in model.named_parameters()}))
    layers = make().num_hidden_layers
    if arch == "gemma2":
        assert varlen_calls == [] and len(calls) == layers
        assert all(c["bias"] is not None and c["softcap"] == 5.0 for c in calls)
    else:
        assert calls == [] and len(varlen_calls) == layers
        cu = [0, 5, 14, 15, 24, 35, 48]
        window = (6, 0) if arch == "mistral" else (-1, -1)
        assert all(c == (cu, 13, dict(causal=True, window=window, softmax_scale=0.25)) for c in varlen_calls)
    (l_ref, g_ref), (l_got, g_got) = outs
    torch.testing.assert_close(l_got, l_ref, rtol=1e-4, atol=2e-5)
    for n in g_ref:
        torch.testing.assert_close(g_got[n], g_ref[n], rtol=1e-4, atol=2e-5, msg=lambda m: f"{n}: {m}")


def _block_mask(rows: list[list[int]], causal=True, window_left=None) -> torch.Tensor:
    """bool (len(rows), 1, n, n): each row's documents, causal / windowed within each."""
    out = []
    for row in rows:
        doc = torch.repeat_interleave(torch.arange(len(row)), torch.tensor(row))
        i = torch.arange(len(doc))
        m = doc[:, None] == doc[None, :]
        if causal:
            m &= i[None, :] <= i[:, None]
        if window_left is not None:
            m &= i[None, :] >= i[:, None] - window_left
        out.append(m)
    return torch.stack(out)[:, None]


def test_documents_of_a_mask(monkeypatch):
    """flashgen.documents.find: exactly the block-diagonal patterns, the batch's offsets flattened,
    memoized per mask object and version; any other mask (one element off, padding, a
    window the layer does not run) is None."""
    monkeypatch.setattr(documents, "ELEMENTS", 100)  # 4 query rows of 2 x 12 keys per step: 3 steps
    rows = [[3, 1, 8], [12]]
    mask = _block_mask(rows)
    cu, longest, doc = documents.find(mask, 2, 12, True, None)
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 3, 4, 12, 24] and longest == 12
    assert doc.tolist() == [[1, 1, 1, 2] + [3] * 8, [1] * 12]
    assert documents.find(mask, 2, 12, True, None)[0] is cu  # memoized: the same offsets object
    # the same documents in each entry of a mask broadcast over the batch
    assert documents.find(_block_mask([[3, 1, 8]]), 3, 12, True, None)[0].tolist() == [0, 3, 4, 12, 15, 16, 24,
                                                                                          27, 28, 36]
    # within a document: bidirectional, or a causal window
    assert documents.find(_block_mask(rows, causal=False), 2, 12, False, None)[0].tolist() == [0, 3, 4, 12, 24]
    win = _block_mask(rows, window_left=2)
    assert documents.find(win, 2, 12, True, 2)[0].tolist() == [0, 3, 4, 12, 24]
    assert documents.find(win, 2, 12, True, None) is None  # the layer runs no window
    assert documents.find(mask, 2, 12, True, 2) is None  # the layer's window is not in the mask
    assert documents.find(mask, 2, 12, False, None) is None  # causal mask, bidirectional layer
    # each pattern asked of a mask is memoized apart (sdpa asks causal, then bidirectional)
    assert {k[1] for k in documents._memo.entries if k[0] == id(mask)} >= {(2, 12, True, None), (2, 12, False, None)}
    assert documents.find(mask, 2, 12, True, None)[0] is cu
    # one element off, in the last chunk: None, and the edit in place is seen (version)
    mask[1, 0, 11, 0] = False
    assert documents.find(mask, 2, 12, True, None) is None
    odd = _block_mask(rows)
    odd[0, 0, 10, 5] = False  # a hole inside a document
    assert documents.find(odd, 2, 12, True, None) is None
    odd = _block_mask(rows)
    odd[0, 0, 9, 1] = True  # a key of another document
    assert documents.find(odd, 2, 12, True, None) is None
    # a padding mask (left padding: the padded rows see no key): None
    pad = _block_mask([[12], [12]])
    pad[1, 0, :, :4] = False
    assert documents.find(pad, 2, 12, True, None) is None


def test_custom_block_mask_runs_as_documents(calls, varlen_calls):
    """A custom 4D block-diagonal bool mask handed to the attention function: the ragged
    batch, the same result as the mask read as a bias; a mask that is the plain causal
    pattern (one document per entry) runs with no mask."""
    mod = _Attn()
    q, k, v = _qkv(b=2, sq=12, sk=12)
    mask = _block_mask([[3, 1, 8], [7, 5]])
    out, w = fg_tf.attention_forward(mod, q, k, v, mask, scaling=0.3)
    assert w is None and out.shape == (2, 12, 4, 16) and out.is_contiguous()
    assert calls == [] and [c[0] for c in varlen_calls] == [[0, 3, 4, 12, 19, 24]]
    want = api.attention(q, k, v, bias=mask, softmax_scale=0.3).transpose(1, 2)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    out, _ = fg_tf.attention_forward(mod, q, k, v, _block_mask([[12], [12]]), scaling=0.3)
    assert len(varlen_calls) == 1 and calls[-1]["causal"] and calls[-1].get("bias") is None
    torch.testing.assert_close(out, api.attention(q, k, v, causal=True, softmax_scale=0.3).transpose(1, 2))
    # with dropout the documents keep the bias path (the ragged-batch kernels have no dropout)
    fg_tf.attention_forward(mod, q, k, v, mask, scaling=0.3, dropout=0.1)
    assert len(varlen_calls) == 1 and calls[-1]["bias"] is mask and calls[-1]["dropout_p"] == 0.1


def test_masks_the_documents_check_does_not_read(calls, varlen_calls):
    """Masks whose values the documents check must not read run as before (the bias):
    an inference tensor (no version counter: transformers' pipelines and generate run
    under inference mode), an empty batch or sequence, a meta tensor (sizes only)."""
    mod = _Attn()
    q, k, v = _qkv(b=2, sq=12, sk=12)
    with torch.inference_mode():
        mask = _block_mask([[3, 1, 8], [7, 5]])
        out, _ = fg_tf.attention_forward(mod, q, k, v, mask, scaling=0.3)
        pad = _padded([3, 0], 12, 12)
        padded, _ = fg_tf.attention_forward(mod, q, k, v, pad, scaling=0.3)
    assert varlen_calls == [] and [c["bias"] is not None for c in calls] == [True, True]
    torch.testing.assert_close(out, api.attention(q, k, v, bias=mask, softmax_scale=0.3).transpose(1, 2))
    torch.testing.assert_close(padded, api.attention(q, k, v, bias=pad, softmax_scale=0.3).transpose(1, 2))
    for b, n, m in ((0, 12, _block_mask([[3, 9]])), (0, 12, torch.ones(0, 1, 12, 12, dtype=torch.bool)),
                    (2, 0, torch.ones(2, 1, 0, 0, dtype=torch.bool))):
        qe, ke, ve = _qkv(b=b, sq=n, sk=n)
        out, _ = fg_tf.attention_forward(mod, qe, ke, ve, m, scaling=0.3)
        assert out.shape == (b, n, 4, 16)
    qm, km, vm = (t.to("meta") for t in _qkv(b=2, sq=12, sk=12))
    out, _ = fg_tf.attention_forward(mod, qm, km, vm, _block_mask([[3, 9], [12]]).to("meta"), scaling=0.3)
    assert out.shape == (2, 12, 4, 16) and out.is_meta
    assert varlen_calls == []


def test_sinks_with_padding_under_inference_mode_trace_once(monkeypatch):
    """gpt-oss with a padding mask under torch.inference_mode (its masks, inference
    tensors, are not memoized): the layers' key padding is one tensor, so the key-padding
    mask_mod is traced once for all layers and forwards, not once per layer."""
    from flashgen import user_mods

    inits = []
    real = user_mods.Traced.__init__
    monkeypatch.setattr(user_mods.Traced, "__init__", lambda self, *a, **kw: inits.append(1) or real(self, *a, **kw))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_gpt_oss(), attn_implementation=NAME).eval()
    ids = torch.randint(0, 96, (2, SEQ), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, SEQ, dtype=torch.long)
    mask[1, :5] = 0
    blocks = []
    real_tiles = user_mods._tiles
    monkeypatch.setattr(user_mods, "_tiles", lambda *a, **k: blocks.append(a[5:]) or real_tiles(*a, **k))
    with torch.inference_mode():
        for _ in range(2):
            model(input_ids=ids, attention_mask=mask, use_cache=False)
    assert 1 <= len(inits) <= 2, len(inits)  # one mask_mod (the window's layer and the full layer share it)
    # and its block masks are computed once per bounds and tile shape, not per layer or forward
    assert blocks and len(blocks) == len(set(blocks)), blocks


def test_register_names():
    assert fg_tf.register() == fg_tf.DEFAULT_NAME == NAME
    assert fg_tf.register("fg_other") == "fg_other"
    assert transformers.AttentionInterface()["fg_other"] is fg_tf.attention_forward
    from transformers.masking_utils import AttentionMaskInterface

    assert AttentionMaskInterface()["fg_other"] is fg_tf.attention_mask
    for bad, word in (("flashgen", "flash"), ("my_FlashGen", "flash"), ("sdpa_fg", "sdpa"), ("org/repo", "/"),
                      ("kernels:fn", ":"), ("paged|fg", "|"), ("eager", "eager"), ("", "non-empty"), (3, "str")):
        with pytest.raises(flashgen.InputError, match=word):
            fg_tf.register(bad)


def _mask_kwargs(**kw):
    from transformers.masking_utils import causal_mask_function, sliding_window_causal_mask_function

    base = dict(batch_size=2, q_length=6, kv_length=6, q_offset=0, kv_offset=0, mask_function=causal_mask_function,
                attention_mask=None, allow_is_causal_skip=True, dtype=torch.float32, config=None, use_vmap=False,
                device="cpu")
    if "local_size" in kw:
        base["mask_function"] = sliding_window_causal_mask_function(kw["local_size"])
        base["config"] = copy.deepcopy(_mistral())
        base["config"].sliding_window = kw["local_size"]
    base.update(kw)
    return base


def test_mask_function():
    from transformers.masking_utils import sdpa_mask

    assert fg_tf.attention_mask(**_mask_kwargs()) is None  # causal, no padding: sdpa's own skip
    # the exact band, kept until the model's attention modules were seen passing their
    # window to attention_forward (per config object); then dropped (window=(2, 0))
    band = _mask_kwargs(local_size=3)
    assert fg_tf.attention_mask(**band) is not None
    fg_tf._record_window(band["config"], False)
    assert fg_tf.attention_mask(**band) is not None
    fg_tf._record_window(band["config"], True)  # once a call left it out, it stays out
    assert fg_tf.attention_mask(**band) is not None
    fg_tf._PASSES_WINDOW.clear()
    fg_tf._record_window(band["config"], True)
    assert fg_tf.attention_mask(**band) is None
    assert fg_tf.attention_mask(**_mask_kwargs(local_size=3)) is not None  # another config object, same class
    # decode step against 5 cached keys with a window of 3: the band again (bottom-right)
    decode = _mask_kwargs(q_length=1, kv_length=6, q_offset=5, local_size=3)
    fg_tf._record_window(decode["config"], True)
    assert fg_tf.attention_mask(**decode) is None
    pad = torch.ones(2, 6, dtype=torch.bool)
    pad[0, 0] = False
    for kw in (dict(attention_mask=pad), dict(attention_mask=pad, local_size=3),
               dict(local_size=3, allow_is_causal_skip=False),
               dict(q_length=4, kv_length=6, q_offset=2)):  # a prefill chunk after 2 cached keys: bottom-right,
        # but sdpa's convention without a mask is top-left, so the mask stays
        got = fg_tf.attention_mask(**_mask_kwargs(**kw))
        want = sdpa_mask(**_mask_kwargs(**kw))
        assert got is not None and got.dtype == torch.bool and torch.equal(got, want), kw
    # a window of at least kv_length keys is the causal band: dropped for any model
    fg_tf._PASSES_WINDOW.clear()
    assert fg_tf.attention_mask(**_mask_kwargs(local_size=6)) is None
    assert fg_tf.attention_mask(**_mask_kwargs(local_size=5)) is not None
    # local_size that is not the config's sliding_window (another kind of local mask): kept
    kw = _mask_kwargs(local_size=3)
    fg_tf._record_window(kw["config"], True)
    kw["config"].sliding_window = 4
    assert fg_tf.attention_mask(**kw) is not None


class _Attn(torch.nn.Module):
    """The attributes of a transformers attention module the functions read."""

    is_causal = True
    num_key_value_groups = 2


def _qkv(b=1, h=4, hk=2, sq=8, sk=8, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, h, sq, d, generator=g), torch.randn(b, hk, sk, d, generator=g),
            torch.randn(b, hk, sk, d, generator=g))


def test_fallbacks_and_reasons(calls):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    mod = _Attn()
    q, k, v = _qkv()
    assert fg_tf.fallback_reason(mod, q, k, v, None) is None
    bias = torch.randn(1, 4, 8, 8)
    cases = [
        (dict(position_bias=bias), "position_bias"),
        (dict(dropout=1.5), "dropout_p"),
        (dict(scaling=float("inf")), "scaling"),
        (dict(sliding_window=0), "sliding_window"),
    ]
    for kw, word in cases:
        reason = fg_tf.fallback_reason(mod, q, k, v, None, **kw)
        assert reason is not None and word in reason, (kw, reason)
    # head_dim 12 (flashgen: a multiple of 8): sdpa runs it, same result, one warning
    q12, k12, v12 = (t[..., :12] for t in (q, k, v))
    assert "head_dim 12" in fg_tf.fallback_reason(mod, q12, k12, v12, None)
    with pytest.warns(UserWarning, match="head_dim 12"):
        out, w = fg_tf.attention_forward(mod, q12, k12, v12, None, scaling=0.3)
    want, _ = sdpa_attention_forward(mod, q12, k12, v12, None, scaling=0.3)
    assert w is None and torch.equal(out, want)
    # a position_bias goes to sdpa with it
    out, _ = fg_tf.attention_forward(mod, q, k, v, None, position_bias=bias)
    want, _ = sdpa_attention_forward(mod, q, k, v, None, position_bias=bias)
    assert torch.equal(out, want)
    # a mask that is not a tensor
    assert "attention_mask of type" in fg_tf.fallback_reason(mod, q, k, v, object())
    assert calls == []  # flashgen ran none of these


def test_fallback_keeps_a_dropped_window_and_softcap():
    """Falling back with no mask but a sliding window (a mask the mask function dropped)
    spells the band out for sdpa; a softcap (which sdpa lacks) falls back to the model's
    eager function."""
    from transformers.models.gemma2 import modeling_gemma2

    mod = _Attn()
    mod.training = False
    q, k, v = (t.double() for t in _qkv(sq=12, sk=12))  # float64: flashgen falls back
    band = fg_tf._band(12, 12, 3, "cpu")[None, None]
    out, _ = fg_tf.attention_forward(mod, q, k, v, None, sliding_window=4)
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    want, _ = sdpa_attention_forward(mod, q, k, v, band)
    torch.testing.assert_close(out, want, rtol=0, atol=0)

    class GemmaLike(_Attn):
        pass

    GemmaLike.__module__ = modeling_gemma2.__name__
    g = GemmaLike()
    g.training = False
    out, _ = fg_tf.attention_forward(g, q, k, v, None, scaling=0.25, sliding_window=4, softcap=3.0)
    want, _ = modeling_gemma2.eager_attention_forward(g, q, k, v, fg_tf._eager_mask(band, q.dtype), scaling=0.25,
                                                      softcap=3.0)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    # and flashgen itself, in float32, agrees with that eager result
    out32, _ = fg_tf.attention_forward(g, q.float(), k.float(), v.float(), None, scaling=0.25, sliding_window=4,
                                       softcap=3.0)
    torch.testing.assert_close(out32.double(), want, rtol=1e-5, atol=1e-5)


def test_dropout_is_flashgens():
    """dropout > 0 runs flashgen's Philox dropout (the interpreter runs it): the same mask
    as flashgen.attention with the same seed."""
    mod = _Attn()
    q, k, v = _qkv()
    flashgen.manual_seed(7)
    out, _ = fg_tf.attention_forward(mod, q, k, v, None, dropout=0.25, scaling=0.3)
    flashgen.manual_seed(7)
    want = flashgen.attention(q, k, v, causal=True, softmax_scale=0.3, dropout_p=0.25)
    assert torch.equal(out, want.transpose(1, 2).contiguous())
    plain, _ = fg_tf.attention_forward(mod, q, k, v, None, scaling=0.3)
    assert not torch.equal(out, plain)


def _gpt_oss_attention(layer, dtype, sinks_std=1.0):
    """A GptOssAttention of the tiny config (layer 0 slides, window 7; layer 1 is global)
    with sinks drawn at ``sinks_std`` (the model initializes them at 0.02, where their
    gradient is small)."""
    from transformers.models.gpt_oss import modeling_gpt_oss

    torch.manual_seed(0)
    att = modeling_gpt_oss.GptOssAttention(_gpt_oss(), layer).to(dtype)
    with torch.no_grad():
        att.sinks.normal_(0.0, sinks_std)
    return att


@pytest.mark.parametrize("layer", [0, 1], ids=["sliding", "full"])
def test_sinks_float16_parameter_matches_eager(layer, calls):
    """gpt-oss's attention called directly, float16 (the kernels in the interpreter) with
    the sinks a float16 parameter: flashgen's output and the gradients of q, k, v and the
    sinks (arriving in float16, the parameter's dtype) match the model's own
    eager_attention_forward run in float64 on the same values, to float16 precision."""
    from transformers.models.gpt_oss import modeling_gpt_oss

    att = _gpt_oss_attention(layer, torch.float16)
    ref = copy.deepcopy(att).double()
    q, k, v = _qkv(b=2, sq=SEQ, sk=SEQ)
    q, k, v = (t.half().requires_grad_() for t in (q, k, v))
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    dout = torch.randn(2, SEQ, 4, 16, generator=torch.Generator().manual_seed(3))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="flashgen:")  # no fallback
        out, w = fg_tf.attention_forward(att, q, k, v, None, scaling=att.scaling, sliding_window=att.sliding_window,
                                         s_aux=att.sinks)
    assert w is None and out.dtype == torch.float16 and len(calls) == 1
    assert calls[0]["window"] == ((6, 0) if layer == 0 else (-1, -1))
    (out.float() * dout).sum().backward()
    window = att.sliding_window - 1 if att.sliding_window else None
    band = fg_tf._eager_mask(fg_tf._band(SEQ, SEQ, window, "cpu")[None, None], torch.float64)
    want, _ = modeling_gpt_oss.eager_attention_forward(ref, q64, k64, v64, band, scaling=att.scaling)
    (want * dout.double()).sum().backward()
    torch.testing.assert_close(out.double(), want, rtol=2e-3, atol=2e-3)
    for name, g, g64 in (("q", q.grad, q64.grad), ("k", k.grad, k64.grad), ("v", v.grad, v64.grad),
                         ("sinks", att.sinks.grad, ref.sinks.grad)):
        assert g.dtype == torch.float16, name
        assert g64.abs().max() > 1e-2, name  # a gradient that is there to compare
        torch.testing.assert_close(g.double(), g64, rtol=5e-3, atol=5e-3, msg=lambda m: f"{name}: {m}")


def test_sinks_fallbacks_and_reasons(calls, monkeypatch):
    """What flashgen's sinks do not combine with (an additive mask, dropout, softcap) and
    s_aux values it does not take fall back, with the rule named; gpt-oss's then run its
    eager_attention_forward (sinks and all).  A bool mask runs flashgen (its mask_mod),
    equal to eager's output, a query row that sees no key giving 0 both ways."""
    from transformers.models.gpt_oss import modeling_gpt_oss

    monkeypatch.setattr(fg_tf, "_warned", set())  # each reason warns once per process
    mod = _Attn()
    q, k, v = _qkv()
    sinks = torch.randn(4)
    assert fg_tf.fallback_reason(mod, q, k, v, None, s_aux=sinks) is None
    assert fg_tf.fallback_reason(mod, q, k, v, None, sliding_window=3, s_aux=sinks.half()) is None
    pad = torch.ones(1, 1, 8, 8, dtype=torch.bool).tril()
    assert fg_tf.fallback_reason(mod, q, k, v, pad, s_aux=sinks) is None
    cases = [
        (fg_tf._eager_mask(pad, q.dtype), dict(s_aux=sinks), "s_aux (attention sinks) with an attention_mask of "
                                                             "torch.float32"),
        (None, dict(s_aux=sinks, dropout=0.1), "s_aux (attention sinks) with dropout > 0"),
        (None, dict(s_aux=sinks, softcap=5.0), "s_aux (attention sinks) with softcap"),
        (None, dict(s_aux=torch.randn(2)), "of shape (2,) (flashgen's sinks: (4,)"),
        (None, dict(s_aux=torch.randn(1, 4)), "of shape (1, 4)"),
        (None, dict(s_aux=torch.arange(4)), "of torch.int64"),
        (None, dict(s_aux=[0.0] * 4), "of list"),
        (None, dict(s_aux=torch.randn(4, device="meta")), "on meta, query on cpu"),
    ]
    for mask, kw, words in cases:
        reason = fg_tf.fallback_reason(mod, q, k, v, mask, **kw)
        assert reason is not None and words in reason, (kw, reason)
    # a padding mask: flashgen, as eager (left-padded rows of entry 1 see no key: 0)
    att = _gpt_oss_attention(0, torch.float32)
    q, k, v = _qkv(b=2, sq=SEQ, sk=SEQ)
    pad = fg_tf._band(SEQ, SEQ, 6, "cpu")[None, None].repeat(2, 1, 1, 1)
    pad[1, :, :, :5] = False  # left padding of entry 1
    out, _ = fg_tf.attention_forward(att, q, k, v, pad, scaling=att.scaling, sliding_window=7, s_aux=att.sinks)
    want, _ = modeling_gpt_oss.eager_attention_forward(att, q, k, v, fg_tf._eager_mask(pad, q.dtype),
                                                       scaling=att.scaling)
    torch.testing.assert_close(out, want, rtol=1e-4, atol=2e-5)
    assert len(calls) == 1 and calls[0]["mask_mod"] is not None and calls[0]["window"] == (6, 0)
    assert out[1, :5].abs().max() < 1e-6  # (batch, seqlen_q, heads, head_dim): no key, 0
    calls.clear()
    # gpt-oss's layers fall back to its eager function with dropout
    att = _gpt_oss_attention(0, torch.float32)
    torch.manual_seed(5)
    with pytest.warns(UserWarning, match="with dropout"):
        out, _ = fg_tf.attention_forward(att, q, k, v, None, dropout=0.25, scaling=att.scaling, sliding_window=7,
                                         s_aux=att.sinks)
    torch.manual_seed(5)
    band = fg_tf._eager_mask(fg_tf._band(SEQ, SEQ, 6, "cpu")[None, None], q.dtype)
    want, _ = modeling_gpt_oss.eager_attention_forward(att, q, k, v, band, dropout=0.25, scaling=att.scaling)
    assert torch.equal(out, want)
    assert calls == []  # flashgen ran none of these


def _padded(batch_pad: list[int], sq: int, sk: int, window_left=None) -> torch.Tensor:
    """(len(batch_pad), 1, sq, sk) bool: causal (bottom-right; a window when given) with
    the first batch_pad[b] keys of entry b padded, as transformers builds it."""
    m = fg_tf._band(sq, sk, window_left, "cpu")[None, None].repeat(len(batch_pad), 1, 1, 1)
    for b, n in enumerate(batch_pad):
        m[b, :, :, :n] = False
    return m


@pytest.mark.parametrize("case", ["padded", "padded-window", "batch-1", "2-d", "decode", "documents",
                                  "documents-window", "random", "per-head"])
def test_sinks_bool_masks_match_eager(case, calls):
    """gpt-oss's sinks with a bool mask: a mask that is causal (and the layer's window)
    with key padding or within packed documents runs flashgen (its bounds, and the key
    padding or the documents as a mask_mod), any
    other falls back to the model's eager_attention_forward with the reason named;
    either way equal to eager in float64, forward and gradients (sinks too), a query row
    that sees no key included."""
    from transformers.models.gpt_oss import modeling_gpt_oss

    sq, sk, window = (1, 12, None) if case == "decode" else (8, 8, 4 if case.endswith("-window") else None)
    mask = {"padded": lambda: _padded([3, 0], sq, sk), "padded-window": lambda: _padded([3, 0], sq, sk, window - 1),
            "batch-1": lambda: _padded([2], sq, sk),  # (1, 1, sq, sk): broadcast over the batch
            "2-d": lambda: fg_tf._band(sq, sk, None, "cpu"),
            "decode": lambda: _padded([5, 0], sq, sk),
            "documents": lambda: _block_mask([[3, 5], [1, 2, 5]]),  # packed sequences
            "documents-window": lambda: _block_mask([[6, 2], [1, 7]], window_left=window - 1),
            "random": lambda: torch.rand(2, 1, sq, sk, generator=torch.Generator().manual_seed(4)) > 0.3,
            "per-head": lambda: _padded([3, 0], sq, sk).expand(2, 4, sq, sk)}[case]()
    runs = case not in ("random", "per-head")
    att = _gpt_oss_attention(0 if window else 1, torch.float32)
    ref = copy.deepcopy(att).double()
    q, k, v = _qkv(b=2, sq=sq, sk=sk)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out, _ = fg_tf.attention_forward(att, q, k, v, mask, scaling=att.scaling, s_aux=att.sinks,
                                         sliding_window=window)
    if runs:
        assert len(calls) == 1 and calls[0]["mask_mod"] is not None and calls[0]["causal"]
        assert calls[0]["window"] == ((window - 1, 0) if window else (-1, -1))
        assert not [w for w in seen if "flashgen:" in str(w.message)]
    else:
        assert calls == []
        assert fg_tf.fallback_reason(att, q, k, v, mask, scaling=att.scaling, s_aux=att.sinks,
                                     sliding_window=window).startswith("s_aux (attention sinks) with an attention_mask")
    want, _ = modeling_gpt_oss.eager_attention_forward(ref, q64, k64, v64, fg_tf._eager_mask(mask, torch.float64),
                                                       scaling=att.scaling)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(5))
    (out * dout).sum().backward()
    (want * dout.double()).sum().backward()
    for name, g, g64 in (("q", q.grad, q64.grad), ("k", k.grad, k64.grad), ("v", v.grad, v64.grad),
                         ("sinks", att.sinks.grad, ref.sinks.grad)):
        torch.testing.assert_close(g.double(), g64, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")


def test_sinks_padding_keeps_no_mask_alive(calls):
    """What the padding path hands to flashgen reads the (batch, seqlen_k) key padding, not
    the mask: after the call (and the backward) the mask is freed, and the layers that
    share one mask share the lowered function (flashgen's memo key)."""
    import gc
    import weakref

    from flashgen import user_mods

    att = _gpt_oss_attention(1, torch.float32)
    refs = []
    for n in range(3):
        q, k, v = (t.requires_grad_() for t in _qkv(b=2, sq=8, sk=8))
        mask = _padded([n + 1, 0], 8, 8)
        out, _ = fg_tf.attention_forward(att, q, k, v, mask, scaling=att.scaling, s_aux=att.sinks)
        out.sum().backward()
        refs.append(weakref.ref(mask))
        keys = fg_tf._key_padding(mask, 8, 8, True, None)
        assert keys.shape == (2, 8) and user_mods._trace_key(fg_tf._padding_mask_mod(keys))[0] == \
            user_mods._trace_key(calls[-1]["mask_mod"])[0]
        del mask, q, k, v, out
    calls.clear()
    gc.collect()
    assert [r() for r in refs] == [None, None, None]


def test_repeated_plain_calls_skip_the_checks_alike(calls, monkeypatch):
    """A call without a mask like an earlier one (every layer of a model after the first)
    takes the earlier call's checks and choices (causal, window, keys cut to seqlen_q):
    the same flashgen.attention call and output as the checked path; an argument the
    checks read that differs (a window, an invalid scale, a module that is not causal,
    is_causal given) is checked again."""
    fg_tf._PLAIN.clear()
    checked = []
    real = fg_tf._reason_and_sinks_mask
    monkeypatch.setattr(fg_tf, "_reason_and_sinks_mask", lambda *a, **k: checked.append(1) or real(*a, **k))
    mod = _Attn()
    q, k, v = _qkv(sq=3, sk=8)
    first, _ = fg_tf.attention_forward(mod, q, k, v, None, scaling=0.25)
    again, _ = fg_tf.attention_forward(mod, q, k, v, None, scaling=0.25)
    assert len(checked) == 1 and calls[0] == calls[1] and torch.equal(first, again)
    assert calls[1]["shapes"] == ((1, 4, 3, 16), (1, 2, 3, 16))  # the keys cut, as sdpa's top-left causal
    n = len(checked)
    for kw in (dict(scaling=0.25, sliding_window=2), dict(scaling=float("inf")), dict(scaling=0.25, is_causal=False),
               dict(scaling=0.25, dropout=0.5), dict(scaling=True)):
        fg_tf.attention_forward(mod, q, k, v, None, **kw)
        assert len(checked) == n + 1, kw
        n += 1
    mod.is_causal = False
    out, _ = fg_tf.attention_forward(mod, q, k, v, None, scaling=0.25)
    assert len(checked) == n + 1 and calls[-1]["causal"] is False and calls[-1]["shapes"][1] == (1, 2, 8, 16)
    fg_tf._PLAIN.clear()


def test_output_attentions_runs_the_models_eager_attention():
    """output_attentions=True: the model's eager attention runs and returns the weights
    (flashgen returned none, with no warning), after a warning naming the reason; the
    next call without it runs flashgen's kernels again."""
    ref, got = _pair(_llama, "eager")
    ids = torch.randint(1, 96, (2, 16), generator=torch.Generator().manual_seed(0))
    fg_tf._warned.clear()
    with torch.no_grad(), pytest.warns(UserWarning, match="output_attentions=True"):
        g = got(input_ids=ids, output_attentions=True)
    with torch.no_grad():
        r = ref(input_ids=ids, output_attentions=True)
    assert len(g.attentions) == len(r.attentions) == 2
    for a, b in zip(g.attentions, r.attentions):
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(g.logits, r.logits)
    q = torch.randn(1, 4, 8, 16)
    k = torch.randn(1, 2, 8, 16)
    mod = got.model.layers[0].self_attn
    assert fg_tf.fallback_reason(mod, q, k, k, None) is None
    assert "output_attentions" in fg_tf.fallback_reason(mod, q, k, k, None, output_attentions=True)
