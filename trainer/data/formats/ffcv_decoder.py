"""A reproducible ``RandomResizedCropRGBImageDecoder``: crop and flip as pure functions of (seed, epoch, index).

FFCV 1.0.2 draws its crop boxes (``get_random_crop``) and flips (``RandomHorizontalFlip``) from numba's
``np.random``, whose per-thread state is seeded from OS entropy: two runs of the same command get different
augmentations, so a resumed run cannot match an uninterrupted one. This subclass keeps FFCV's decoder, crop
sampler (``get_random_crop``) and resize (``libffcv.resize_crop``) and only re-seeds numba's generator per
sample from ``(seed, epoch, sample index)`` before drawing, the same contract as the ImageFolder path
(:func:`trainer.data.formats.imagefolder.sample_seed`). The flip is drawn from the same per-sample stream, inside the
decoder, because FFCV's flip operation never sees sample indices.

Imported only after :func:`trainer.data.formats.ffcv.require_ffcv` (it imports ffcv at module level).
"""

from __future__ import annotations

import numpy as np
from ffcv.fields.rgb_image import IMAGE_MODES, RandomResizedCropRGBImageDecoder
from ffcv.libffcv import imdecode, resize_crop
from ffcv.pipeline.compiler import Compiler

_GOLDEN, _M1, _M2 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _splitmix(x):
    """SplitMix64 finaliser on a numpy uint64 (wrapping arithmetic; runs in Python and under numba)."""
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


class SeededRandomResizedCropDecoder(RandomResizedCropRGBImageDecoder):
    """FFCV ``RandomResizedCropRGBImageDecoder`` + horizontal flip, reproducible per (seed, epoch, index).

    Output: uint8 (B, output_size[0], output_size[1], 3), HWC like FFCV's decoder. ``epoch`` and
    ``output_size`` are set by the loader before each epoch; ``epoch`` is compiled into the code, so the
    loader owning this decoder must be built with ``recompile=True`` (FFCV's option for augmentations that
    change during training; one numba compilation per epoch). ``output_size`` needs no recompilation (FFCV
    allocates the buffers per epoch), as in ffcv-imagenet's progressive resizing.
    """

    def __init__(self, output_size, scale=(0.08, 1.0), ratio=(0.75, 4 / 3), flip_prob: float = 0.5, seed: int = 0):
        super().__init__(output_size, scale=scale, ratio=ratio)
        self.flip_prob, self.seed, self.epoch = float(flip_prob), int(seed), 0

    def epoch_key(self) -> np.uint64:
        """uint64 key of (seed, epoch); a sample's generator seed is derived from it and the sample index."""
        with np.errstate(over="ignore"):
            return _splitmix(np.uint64(self.seed) * _GOLDEN + _splitmix(np.uint64(self.epoch) + _GOLDEN))

    def generate_code(self):
        jpg = IMAGE_MODES["jpg"]
        mem_read = self.memory_read
        my_range = Compiler.get_iterator()
        imdecode_c = Compiler.compile(imdecode)
        resize_crop_c = Compiler.compile(resize_crop)
        get_crop_c = Compiler.compile(self.get_crop_generator)
        mix_c = Compiler.compile(_splitmix)
        scale, ratio = np.array(self.scale), np.array(self.ratio)
        key, flip_prob = self.epoch_key(), self.flip_prob

        def decode(batch_indices, my_storage, metadata, storage_state):
            destination, temp_storage = my_storage
            for dst_ix in my_range(len(batch_indices)):
                source_ix = batch_indices[dst_ix]
                field = metadata[source_ix]
                image_data = mem_read(field["data_ptr"], storage_state)
                height = np.uint32(field["height"])
                width = np.uint32(field["width"])
                if field["mode"] == jpg:
                    temp_buffer = temp_storage[dst_ix]
                    imdecode_c(image_data, temp_buffer, height, width, height, width, 0, 0, 1, 1, False, False)
                    temp_buffer = temp_buffer.reshape(-1)[: 3 * height * width].reshape(height, width, 3)
                else:
                    temp_buffer = image_data.reshape(height, width, 3)
                np.random.seed(np.uint32(mix_c(key + np.uint64(source_ix)) >> np.uint64(33)))
                i, j, h, w = get_crop_c(height, width, scale, ratio)
                flip = np.random.random() < flip_prob
                resize_crop_c(temp_buffer, i, i + h, j, j + w, destination[dst_ix])
                if flip:
                    destination[dst_ix] = destination[dst_ix][:, ::-1].copy()
            return destination[: len(batch_indices)]

        decode.is_parallel = True
        return decode
