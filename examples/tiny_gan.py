"""A tiny GAN on generated 2-D points: two optimizers, two schedulers and a custom step,
brought with --workload, living outside the trainer package.

    python -m trainer --output outputs/gan --workload examples/tiny_gan.py:TinyGAN \
        --batch-size 16 --epochs 4

What it exercises:
- `build_optimizer` returns named optimizers (`{"generator": Adam, "discriminator": Adam}`)
  and `build_scheduler` named schedulers; each is saved under its name (`optim.generator...`).
  Adam creates its state lazily, at the first step: the trainer materialises it before a
  restore, so it restores exactly.
- `train_step(model, optimizers, batches, step)`: the discriminator's update, then the
  generator's, over the window of micro-batches (`--grad-accum`), through `step.autocast()`,
  `step.backward()` and `step.step()`, which keep the trainer's mixed precision, accumulation
  and `after_backward` clipping.
- `--gan-discriminator-optimizer stateful`: the discriminator's Adam kept in `stateful()` instead
  (the trainer materialises an optimizer it finds there too).
- An EMA of the generator's weights created at the first step as a dict of tensors: stored
  entries a fresh process lacks are allocated from the generation and handed to its
  `load_state_dict`.
The points are drawn once from a seeded generator: no download.
"""

from __future__ import annotations

import hashlib
import math

import torch
from torch import nn

from trainer.options import positive_float, positive_int

NOISE = 4


class Ring(torch.utils.data.Dataset):
    """`samples` points around 8 Gaussian blobs on a circle."""

    def __init__(self, samples: int, seed: int):
        generator = torch.Generator().manual_seed(seed)
        blob = torch.randint(0, 8, (samples,), generator=generator).float() * (2 * math.pi / 8)
        centres = torch.stack([blob.cos(), blob.sin()], dim=1) * 2
        self.points = centres + 0.05 * torch.randn(samples, 2, generator=generator)

    def __len__(self) -> int:
        return len(self.points)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.points[index]

    def fingerprint(self) -> str:
        return hashlib.sha256(self.points.numpy().tobytes()).hexdigest()


class LazyEMA:
    """An average of the generator's weights, allocated at its first update (a dict that grows)."""

    def __init__(self, decay: float = 0.9):
        self.decay, self.average = decay, {}

    def update(self, generator: nn.Module) -> None:
        for name, parameter in generator.named_parameters():
            value = parameter.detach()
            kept = self.average.get(name)
            self.average[name] = value.clone() if kept is None else self.decay * kept + (1 - self.decay) * value

    def state_dict(self) -> dict:
        return dict(self.average)

    def load_state_dict(self, state: dict) -> None:
        self.average = {name: value.clone() for name, value in state.items()}


def mlp(inputs: int, outputs: int, width: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(inputs, width), nn.LeakyReLU(0.2), nn.Linear(width, outputs))


class TinyGAN:
    @staticmethod
    def add_options(group) -> None:
        group.add_argument("--gan-width", type=positive_int, default=16, help="hidden units of both networks")
        group.add_argument("--gan-lr", type=positive_float, default=2e-3)
        group.add_argument("--gan-samples", type=positive_int, default=64)
        group.add_argument("--gan-discriminator-optimizer", choices=("named", "stateful"), default="named",
                           help="the discriminator's Adam returned by build_optimizer, or kept in stateful()")

    def __init__(self, options):
        self.options = options
        self.ema = LazyEMA()
        self.kept_discriminator = None

    def build_dataset(self):
        return Ring(self.options.gan_samples, self.options.seed)

    def build_model(self) -> nn.Module:
        width = self.options.gan_width
        return nn.ModuleDict({"generator": mlp(NOISE, 2, width), "discriminator": mlp(2, 1, width)})

    def build_optimizer(self, model):
        adam = lambda module: torch.optim.Adam(module.parameters(), lr=self.options.gan_lr, betas=(0.5, 0.9))
        generator, discriminator = adam(model["generator"]), adam(model["discriminator"])
        if self.options.gan_discriminator_optimizer == "stateful":
            self.kept_discriminator = discriminator
            return {"generator": generator}
        return {"generator": generator, "discriminator": discriminator}

    def build_scheduler(self, optimizers):
        return {name: torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + 0.05 * step))
                for name, optimizer in optimizers.items()}

    def loss(self, model, batch) -> torch.Tensor:
        raise NotImplementedError("train_step runs this workload's steps")

    def train_step(self, model, optimizers, batches, step) -> torch.Tensor:
        nets = getattr(model, "module", model)  # DDP wraps the ModuleDict
        generator, discriminator = nets["generator"], nets["discriminator"]
        discriminator_optimizer = self.kept_discriminator or optimizers["discriminator"]
        bce = nn.functional.binary_cross_entropy_with_logits
        for real in batches:
            with step.autocast():
                fake = generator(torch.randn(len(real), NOISE)).detach()  # global RNG: saved by the trainer
                real_score, fake_score = discriminator(real), discriminator(fake)
                loss = bce(real_score, torch.ones_like(real_score)) + bce(fake_score, torch.zeros_like(fake_score))
            step.backward(loss)
        step.step(discriminator_optimizer)
        total = 0.0
        for real in batches:
            with step.autocast():
                score = discriminator(generator(torch.randn(len(real), NOISE)))
                loss = bce(score, torch.ones_like(score))
            step.backward(loss)
            total = total + loss.detach().float() / len(batches)
        step.step(optimizers["generator"])
        return total

    def after_backward(self, model, optimizer) -> None:
        """Clip the gradients of the optimizer about to step."""
        parameters = [parameter for group in optimizer.param_groups for parameter in group["params"]]
        torch.nn.utils.clip_grad_norm_(parameters, 1.0)

    def after_step(self, model, optimizers) -> None:
        self.ema.update(model["generator"])

    def stateful(self) -> dict:
        extras = {"generator_ema": self.ema}
        if self.kept_discriminator is not None:
            extras["discriminator_optimizer"] = self.kept_discriminator
        return extras

    def architecture(self) -> dict:
        return {"architecture": "tiny-gan", "noise": NOISE, "width": self.options.gan_width}
