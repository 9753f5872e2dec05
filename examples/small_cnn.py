"""A small CNN on generated 16x16 images: a workload brought with --workload, living outside
the trainer package.

    python -m trainer --output outputs/cnn --workload examples/small_cnn.py:SmallCNN \
        --batch-size 16 --num-workers 2 --epochs 4

What it exercises: the torchvision habit of augmenting inside the Dataset with the global
RNGs (pad-and-crop offsets from `torch.randint`, a flip from `random.random()`) while
DataLoader workers fetch (made exact by the trainer's per-sample seeding), BatchNorm (running
statistics are buffers: saved with the model), OneCycleLR over `--cnn-total-steps` optimizer
steps, and label smoothing. The images are drawn once from a seeded generator: no download.
"""

from __future__ import annotations

import hashlib
import random

import torch
from torch import nn

from trainer.errors import UsageError
from trainer.options import positive_float, positive_int, unit_interval


class Stripes(torch.utils.data.Dataset):
    """`samples` 3x16x16 images of `classes` kinds: stripes of a class-specific direction and
    frequency, plus noise; augmented on every fetch by a 2-pixel pad-and-crop and a flip."""

    def __init__(self, samples: int, classes: int, seed: int, size: int = 16):
        generator = torch.Generator().manual_seed(seed)
        self.labels = torch.randint(0, classes, (samples,), generator=generator)
        grid = torch.arange(size, dtype=torch.float32)
        images = []
        for label in self.labels.tolist():
            frequency, vertical = 1 + label % 4, label % 2 == 0
            wave = torch.sin(grid * frequency * 0.8 + float(torch.rand((), generator=generator)) * 6.28)
            pattern = wave.expand(size, size) if vertical else wave[:, None].expand(size, size)
            colour = torch.rand(3, 1, 1, generator=generator)
            images.append(pattern * colour + 0.3 * torch.randn(3, size, size, generator=generator))
        self.images = torch.stack(images)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        image = nn.functional.pad(self.images[index], (2, 2, 2, 2))
        top, left = torch.randint(0, 5, (2,)).tolist()
        image = image[:, top:top + 16, left:left + 16]
        if random.random() < 0.5:
            image = image.flip(-1)
        return image, self.labels[index]

    def fingerprint(self) -> str:
        digest = hashlib.sha256(self.images.numpy().tobytes())
        digest.update(self.labels.numpy().tobytes())
        return digest.hexdigest()


class Network(nn.Module):
    def __init__(self, channels: int, classes: int):
        super().__init__()

        def stage(inputs: int, outputs: int) -> nn.Sequential:
            return nn.Sequential(nn.Conv2d(inputs, outputs, 3, padding=1, bias=False), nn.BatchNorm2d(outputs),
                                 nn.ReLU(), nn.MaxPool2d(2))

        self.features = nn.Sequential(stage(3, channels), stage(channels, 2 * channels))
        self.classifier = nn.Linear(2 * channels, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(images).mean(dim=(2, 3)))


class SmallCNN:
    @staticmethod
    def add_options(group) -> None:
        group.add_argument("--cnn-images", type=positive_int, default=64)
        group.add_argument("--cnn-classes", type=positive_int, default=4)
        group.add_argument("--cnn-channels", type=positive_int, default=8)
        group.add_argument("--cnn-max-lr", type=positive_float, default=0.05)
        group.add_argument("--cnn-total-steps", type=positive_int, default=64,
                           help="optimizer steps of the one-cycle schedule (a run may not exceed it)")
        group.add_argument("--cnn-label-smoothing", type=unit_interval, default=0.1)

    def __init__(self, options):
        self.options = options
        # OneCycleLR cannot step past its end: refuse a run longer than the schedule up front
        # (epochs are not fingerprinted, so a run may be extended; the schedule length is).
        steps = options.epochs * -(-(-(-options.cnn_images // options.batch_size)) // options.grad_accum)
        if steps > options.cnn_total_steps:
            raise UsageError(f"--epochs {options.epochs} needs {steps} optimizer steps, but the one-cycle "
                             f"schedule has --cnn-total-steps {options.cnn_total_steps}; lower --epochs, or raise "
                             f"--cnn-total-steps in a new run (it changes training)")

    def build_dataset(self) -> Stripes:
        return Stripes(self.options.cnn_images, self.options.cnn_classes, self.options.seed)

    def build_model(self) -> nn.Module:
        return Network(self.options.cnn_channels, self.options.cnn_classes)

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD(model.parameters(), lr=self.options.cnn_max_lr, momentum=0.9, nesterov=True,
                               weight_decay=5e-4)

    def build_scheduler(self, optimizer: torch.optim.Optimizer):
        return torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=self.options.cnn_max_lr,
                                                   total_steps=self.options.cnn_total_steps)

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        images, labels = batch
        return nn.functional.cross_entropy(model(images), labels, label_smoothing=self.options.cnn_label_smoothing)

    def architecture(self) -> dict:
        o = self.options
        return {"architecture": "SmallCNN", "channels": o.cnn_channels, "classes": o.cnn_classes, "image_size": 16}
