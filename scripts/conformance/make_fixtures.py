"""Builds lmrr's conformance fixtures with transformers itself.

For each family, a tiny random checkpoint made the way a user's would be:
`AutoConfig.for_model(model_type, **small dims)`, `AutoModelForCausalLM
.from_config`, weights drawn again from one seeded generator at scales that
make attention and routing non-trivial, `save_pretrained(safe_serialization=
True)` (one family sharded, with `model.safetensors.index.json`), a tiny
byte-level BPE `tokenizer.json` built with the `tokenizers` package, a
`tokenizer_config.json` with a chat template (a string, or a list of named
templates for one family), and transformers' float64 logits (`model.double()`)
for three prompts given as token ids (so the tokenizer does not matter to
them). The longest prompt runs past the sliding window of the families that
have one; in MoE families every expert of every MoE layer is chosen by some
token of the prompts (checked here, from the experts' own inputs).

Output, per family, under engine/tests/fixtures/conformance/<name>/:
  the checkpoint files, `logits.f64` (little-endian float64: every prompt's
  (len, vocab) logits, prompts in order) and `conformance.json`: the prompts,
  vocab, the transformers / torch / tokenizers versions, the seed, the
  maximum top-1 margin statistics, and per prompt its byte offset in
  `logits.f64`.

Each fixture is then loaded back from disk by transformers and must reproduce
its logits bit for bit.

Run: python3 -m venv target/conformance-venv
     target/conformance-venv/bin/pip install torch transformers safetensors tokenizers numpy
     target/conformance-venv/bin/python scripts/conformance/make_fixtures.py [family ...]
"""
import json
import os
import shutil
import sys

import numpy as np
import tokenizers
import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
OUT = os.path.join(ROOT, "engine", "tests", "fixtures", "conformance")
SEED = 20261206
VOCAB = 320
# Every family: hidden 64, heads 4 (2 KV heads), head_dim 16.
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
SLIDING = 16
# Prompt lengths: the last runs past every sliding window (SLIDING).
PROMPT_LENS = [7, 23, 48]

FAMILIES = {
    "llama": dict(
        model_type="llama",
        cfg=dict(num_hidden_layers=3, tie_word_embeddings=False),
        shard="120KB",
    ),
    "llama_rope_llama3": dict(
        model_type="llama",
        cfg=dict(
            num_hidden_layers=3,
            tie_word_embeddings=True,
            rope_theta=10000.0,
            rope_scaling=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=32,
            ),
        ),
        # generation_config.json with a second EOS id (merged by lmrr).
        generation_eos=[2, 5],
        template_list=True,
    ),
    "qwen2": dict(
        model_type="qwen2",
        cfg=dict(num_hidden_layers=3, tie_word_embeddings=False, rope_theta=1000000.0),
    ),
    "qwen3": dict(
        model_type="qwen3",
        cfg=dict(num_hidden_layers=3, tie_word_embeddings=True, rope_theta=1000000.0),
    ),
    "mistral": dict(
        model_type="mistral",
        cfg=dict(num_hidden_layers=3, sliding_window=SLIDING, tie_word_embeddings=False),
    ),
    "gemma3_text": dict(
        model_type="gemma3_text",
        cfg=dict(
            num_hidden_layers=4,
            sliding_window=SLIDING,
            # Two sliding layers, then a global one, then a sliding one.
            layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
            query_pre_attn_scalar=16,
            rope_parameters={
                "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
            hidden_activation="gelu_pytorch_tanh",
            tie_word_embeddings=True,
        ),
    ),
    "qwen3_moe": dict(
        model_type="qwen3_moe",
        cfg=dict(
            num_hidden_layers=2,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            decoder_sparse_step=1,
            norm_topk_prob=True,
            tie_word_embeddings=False,
        ),
        router_std=0.5,
    ),
    "mixtral": dict(
        model_type="mixtral",
        cfg=dict(
            num_hidden_layers=2,
            num_local_experts=4,
            num_experts_per_tok=2,
            intermediate_size=64,
            tie_word_embeddings=False,
        ),
        router_std=0.5,
        shard="150KB",
    ),
    "deepseek_v3": dict(
        model_type="deepseek_v3",
        cfg=dict(
            num_hidden_layers=3,
            first_k_dense_replace=1,
            intermediate_size=128,
            moe_intermediate_size=32,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_shared_experts=1,
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            num_key_value_heads=4,
            q_lora_rank=32,
            kv_lora_rank=32,
            qk_rope_head_dim=8,
            qk_nope_head_dim=16,
            v_head_dim=16,
            head_dim=8,
            rope_theta=10000.0,
            rope_scaling=dict(
                rope_type="yarn",
                factor=4.0,
                original_max_position_embeddings=64,
                beta_fast=32,
                beta_slow=1,
                mscale=1.0,
                mscale_all_dim=1.0,
            ),
            tie_word_embeddings=False,
        ),
        router_std=0.5,
    ),
}

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog. ",
    "def reverse(xs):\n    return xs[::-1]\n",
    "Determinism means the same bits every run, batched or alone, cached or not. ",
    "Zorblax the facts, retry, interrupt, to a file, recall. ",
]


def make_tokenizer(path):
    """A byte-level BPE of exactly VOCAB ids (specials first), trained on CORPUS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>", "<eot>"]
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 50, trainer)
    assert tok.get_vocab_size() <= VOCAB, tok.get_vocab_size()
    tok.save(path)


def prompts(rng):
    """Token ids: the three prompts (ids 3..VOCAB, past the specials that end generation)."""
    return [[int(x) for x in rng.integers(3, VOCAB, size=n)] for n in PROMPT_LENS]


def reinit(model, gen, router_std):
    """Redraws every tensor of the state dict from `gen`, in name order."""
    sd = model.state_dict()
    with torch.no_grad():
        for name in sorted(sd):
            t = sd[name]
            if not t.is_floating_point():
                continue
            leaf = name.rsplit(".", 1)[-1]
            if "norm" in name or "layernorm" in name:
                # Norm scales near one (Gemma's are stored as an offset from one).
                base = 0.0 if "gemma" in type(model).__name__.lower() else 1.0
                v = base + 0.1 * torch.randn(t.shape, generator=gen, dtype=torch.float64)
            elif "e_score_correction_bias" in name:
                v = 0.1 * torch.randn(t.shape, generator=gen, dtype=torch.float64)
            elif leaf == "bias":
                v = 0.1 * torch.randn(t.shape, generator=gen, dtype=torch.float64)
            elif name.endswith("gate.weight") and ("experts" not in name) and router_std:
                v = router_std * torch.randn(t.shape, generator=gen, dtype=torch.float64)
            elif "embed_tokens" in name:
                v = 0.5 * torch.randn(t.shape, generator=gen, dtype=torch.float64)
            else:
                v = 0.1 * torch.randn(t.shape, generator=gen, dtype=torch.float64)
            t.copy_(v.to(t.dtype))


def experts_seen(model, ids_list):
    """For every experts module, the set of experts chosen over the prompts."""
    seen = {}
    hooks = []
    for name, mod in model.named_modules():
        if type(mod).__name__.endswith("Experts"):
            def pre(mod, args, name=name):
                seen.setdefault(name, set()).update(int(x) for x in args[1].flatten().tolist())
            hooks.append(mod.register_forward_pre_hook(pre))
    with torch.no_grad():
        for ids in ids_list:
            model(torch.tensor([ids]))
    for h in hooks:
        h.remove()
    return seen


def logits_f64(model, ids_list):
    with torch.no_grad():
        return [model(torch.tensor([ids])).logits[0].numpy().astype("<f8") for ids in ids_list]


def build(name, spec):
    out = os.path.join(OUT, name)
    if os.path.isdir(out):
        shutil.rmtree(out)
    os.makedirs(out)
    kw = dict(COMMON)
    kw.update(spec["cfg"])
    cfg = AutoConfig.for_model(spec["model_type"], **kw)
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(
        cfg, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager"
    )
    model.eval()
    gen = torch.Generator().manual_seed(SEED)
    reinit(model, gen, spec.get("router_std", 0.0))
    if spec.get("generation_eos"):
        model.generation_config.eos_token_id = spec["generation_eos"]
    save = dict(safe_serialization=True)
    if spec.get("shard"):
        save["max_shard_size"] = spec["shard"]
    model.save_pretrained(out, **save)
    make_tokenizer(os.path.join(out, "tokenizer.json"))
    template = (
        [{"name": "default", "template": CHAT_TEMPLATE}, {"name": "tool_use", "template": CHAT_TEMPLATE}]
        if spec.get("template_list")
        else CHAT_TEMPLATE
    )
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump(
            {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "chat_template": template},
            f,
            indent=2,
        )
    rng = np.random.default_rng(SEED + sum(map(ord, name)))
    ids_list = prompts(rng)

    model64 = model.double()
    logits = logits_f64(model64, ids_list)
    seen = experts_seen(model64, ids_list)
    n_experts = cfg.to_dict().get("num_experts") or cfg.to_dict().get("num_local_experts") or cfg.to_dict().get("n_routed_experts")
    for mod, s in seen.items():
        assert s == set(range(n_experts)), f"{name}: {mod} chose only {sorted(s)}"
    margins = []
    for lg in logits:
        top2 = np.sort(lg, axis=-1)[:, -2:]
        margins.extend((top2[:, 1] - top2[:, 0]).tolist())

    # Reload from disk: the same logits, bit for bit.
    again = AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager"
    ).double().eval()
    for a, b in zip(logits, logits_f64(again, ids_list)):
        assert np.array_equal(a, b), f"{name}: reloaded checkpoint gives other logits"

    blob = b"".join(lg.tobytes() for lg in logits)
    with open(os.path.join(out, "logits.f64"), "wb") as f:
        f.write(blob)
    offsets, off = [], 0
    for lg in logits:
        offsets.append(off)
        off += lg.nbytes
    manifest = {
        "family": name,
        "model_type": spec["model_type"],
        "made_by": "scripts/conformance/make_fixtures.py",
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "tokenizers": tokenizers.__version__,
        "seed": SEED,
        "vocab_size": VOCAB,
        "logits": "logits.f64: little-endian float64, (len, vocab_size) per prompt, prompts in order",
        "prompts": [{"ids": ids, "offset": o} for ids, o in zip(ids_list, offsets)],
        "min_top2_margin": min(margins),
        "experts_reached": {k: len(v) for k, v in sorted(seen.items())},
        "sharded": os.path.exists(os.path.join(out, "model.safetensors.index.json")),
    }
    with open(os.path.join(out, "conformance.json"), "w") as f:
        json.dump(manifest, f, indent=1)
        f.write("\n")
    size = sum(os.path.getsize(os.path.join(out, x)) for x in os.listdir(out))
    print(f"{name}: {size / 1e6:.2f} MB, sharded={manifest['sharded']}, min margin {min(margins):.3g}, experts {manifest['experts_reached']}")


def main():
    torch.use_deterministic_algorithms(True)
    names = sys.argv[1:] or list(FAMILIES)
    for n in names:
        build(n, FAMILIES[n])


if __name__ == "__main__":
    main()
