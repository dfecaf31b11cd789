"""A ResNet-50 layout at small width: what torchvision's ``resnet50`` builds, written out
(torchvision has no CPU wheel for this torch here).

Bottleneck blocks in the real 3-4-6-3 layout, each ``conv1x1 → conv3x3 (stride) →
conv1x1 (×4)`` with BatchNorm after every convolution, a projection shortcut on the first
block of a stage, and the in-place residual add ``out += identity`` followed by an in-place
ReLU; the stem is ``conv7x7/2 → BatchNorm → ReLU(inplace=True) → maxpool``, with the ReLU a
module (a layer) of its own. ``width`` scales every channel count (torchvision's is 64).
"""

from __future__ import annotations

import torch
import torch.nn as nn

LAYOUT = (3, 4, 6, 3)


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1,
                 downsample: nn.Module | None = None) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, planes * self.expansion, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        return self.relu(out)


class ResNet(nn.Module):
    def __init__(self, width: int = 8, num_classes: int = 10,
                 layout: tuple[int, ...] = LAYOUT) -> None:
        super().__init__()
        self.inplanes = width
        self.conv1 = nn.Conv2d(3, width, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        self.layer1 = self._stage(width, layout[0])
        self.layer2 = self._stage(width * 2, layout[1], stride=2)
        self.layer3 = self._stage(width * 4, layout[2], stride=2)
        self.layer4 = self._stage(width * 8, layout[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(width * 8 * Bottleneck.expansion, num_classes)

    def _stage(self, planes: int, blocks: int, stride: int = 1) -> nn.Sequential:
        downsample = None
        if stride != 1 or self.inplanes != planes * Bottleneck.expansion:
            downsample = nn.Sequential(
                nn.Conv2d(self.inplanes, planes * Bottleneck.expansion, 1, stride=stride,
                          bias=False),
                nn.BatchNorm2d(planes * Bottleneck.expansion),
            )
        layers = [Bottleneck(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes * Bottleneck.expansion
        layers += [Bottleneck(self.inplanes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet_layout(width: int = 8, num_classes: int = 10, seed: int = 0,
                  layout: tuple[int, ...] = LAYOUT) -> ResNet:
    """The seeded small-width ResNet (by default the ResNet-50 layout), in training mode."""
    torch.manual_seed(seed)
    return ResNet(width, num_classes, layout)


def image_batch(batch: int, size: int = 32, num_classes: int = 10, seed: int = 0
                ) -> tuple[tuple[torch.Tensor], torch.Tensor]:
    """Random images (batch, 3, size, size) and class labels, seeded."""
    gen = torch.Generator().manual_seed(seed)
    images = torch.randn(batch, 3, size, size, generator=gen)
    return (images,), torch.randint(0, num_classes, (batch,), generator=gen)
