"""Training: a few Trainer steps lower the loss; gradient checkpointing gives the same gradients."""

import torch
from conftest import randomize_lazy, tiny_model
from torch.utils.data import Dataset
from transformers import Trainer, TrainingArguments

from modeling_lazy.modeling_lazy import is_lazy_parameter


class RepeatingDataset(Dataset):
    """Short sequences with a learnable pattern (each row is an arithmetic progression mod vocab)."""

    def __init__(self, rows=32, length=24, vocab=97):
        starts = torch.randint(3, vocab, (rows, 1))
        steps = torch.randint(1, 4, (rows, 1))
        self.ids = (starts + steps * torch.arange(length)) % (vocab - 3) + 3

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def test_trainer_steps_lower_the_loss(tmp_path, rng_seed):
    model = tiny_model()
    model.train()
    data = RepeatingDataset()
    batch = {k: torch.stack([data[i][k] for i in range(len(data))]) for k in ("input_ids", "labels")}
    with torch.no_grad():
        before = model(**batch).loss.item()
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=8, num_train_epochs=4,
                             learning_rate=5e-3, logging_steps=1, save_strategy="no", report_to=[],
                             use_cpu=True, gradient_checkpointing=True, disable_tqdm=True)
    Trainer(model=model, args=args, train_dataset=data).train()
    with torch.no_grad():
        after = model(**batch).loss.item()
    assert after < before * 0.8, (before, after)


def test_gradient_checkpointing_gives_the_same_gradients(rng_seed):
    model = tiny_model()
    model.train()
    ids = torch.randint(3, 97, (2, 16))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    grads = []
    for checkpointing in (False, True):
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.zero_grad()
        model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    assert model.is_gradient_checkpointing
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, atol=1e-6, rtol=1e-5, msg=name)


def test_trainer_bf16_keeps_tau_and_bias_float32_and_trains_every_entry(tmp_path, rng_seed):
    """`Trainer(bf16=True, bf16_full_eval=True)` on a model cast to bfloat16 (Trainer casts it again for the
    full-bf16 evaluation): tau and distance_bias stay float32 and every entry moves."""
    model = tiny_model(lazy_bias_window=6)
    randomize_lazy(model, tau_scale=0.25)  # no dead head (an all-zero head has no gradient)
    model.to(torch.bfloat16).train()
    lazy = {n: p for n, p in model.named_parameters() if is_lazy_parameter(n)}
    start = {n: p.detach().clone() for n, p in lazy.items()}
    data = RepeatingDataset(rows=8, length=16)
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=4, learning_rate=1e-4,
                             save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True, bf16=True,
                             bf16_full_eval=True)
    trainer = Trainer(model=model, args=args, train_dataset=data, eval_dataset=data)
    trainer.evaluate()
    trainer.train()
    trainer.evaluate()
    assert model.model.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16
    for name, param in model.named_parameters():
        if is_lazy_parameter(name):
            assert param.dtype == torch.float32, name
            moved = param.detach() != start[name]
            assert moved.all(), f"{name}: {int(moved.sum())} of {moved.numel()} entries moved (seed {rng_seed})"


def test_updates_the_version_counter_misses_reach_the_next_call(rng_seed):
    """The facts kept about tau and the distance bias between calls (all zero: plain softmax; the decode's reversed
    bias table) follow updates that leave PyTorch's version counter as it was: a fused AdamW step (transformers'
    default optimizer) and, after `forget_parameter_facts()`, a write through `.data`. Checked against the float64
    oracle after each, for a prefill and for cached decoding."""
    from reference64 import lazy_llama_logits64

    from modeling_lazy.lazy_attention_ops import forget_parameter_facts

    model = tiny_model()
    with torch.no_grad():
        for layer in model.model.layers:  # a converted Llama: plain softmax until trained
            layer.self_attn.tau.zero_()
            layer.self_attn.distance_bias.zero_()
    ids = torch.randint(3, 97, (2, 12))

    def check(label):
        with torch.no_grad():
            full = model(ids).logits
            assert (full.double() - lazy_llama_logits64(model, ids)).abs().max() < 1e-4, f"{label}, seed {rng_seed}"
            out = model(ids[:, :-3], use_cache=True)  # the decode path's bias table
            for t in range(ids.shape[1] - 3, ids.shape[1]):
                out = model(ids[:, t:t + 1], cache=out.past_key_values, use_cache=True)
                torch.testing.assert_close(out.logits[:, -1], full[:, t], atol=1e-4, rtol=1e-4, msg=label)

    check("before training")
    lazy = [p for name, p in model.named_parameters() if is_lazy_parameter(name)]
    optimizer = torch.optim.AdamW(lazy, lr=0.5, fused=True)
    model.train()
    model(ids, labels=ids).loss.backward()
    versions = [p._version for p in lazy]
    optimizer.step()
    assert [p._version for p in lazy] == versions  # unseen by the counter: the hook on optimizer steps sees it
    model.eval()
    assert all(p.abs().sum() > 0 for p in lazy)
    check("after a fused AdamW step")
    for layer in model.model.layers:
        layer.self_attn.tau.data.fill_(-0.7)
        layer.self_attn.distance_bias.data.normal_()
    forget_parameter_facts()
    check("after writes through .data")
