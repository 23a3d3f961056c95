"""Training: a few Trainer steps lower the loss; gradient checkpointing gives the same gradients."""

import torch
from conftest import tiny_model
from torch.utils.data import Dataset
from transformers import Trainer, TrainingArguments


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
