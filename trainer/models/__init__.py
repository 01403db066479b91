"""Models that torchvision does not ship, written in this repository on its own ops.

- :mod:`trainer.models.dino`: DINO-4scale detector (Zhang et al. 2022, arXiv 2203.03605) on the multi-scale
  deformable attention op :mod:`trainer.ops.msda`.

Importing this package imports nothing heavy; import the sub-package you need.
"""
