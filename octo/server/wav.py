"""WAV uploads decoded without ffmpeg: a host without ffmpeg still transcribes the commonest format.

ffmpeg decodes every upload when it is installed (``octo.server.routes.audio``); without it, a RIFF/WAVE file of
integer PCM (8, 16, 24 or 32 bits) or IEEE float (32 or 64 bits), plain or ``WAVE_FORMAT_EXTENSIBLE``, is read here:
its channels averaged to mono and, when it is not at 16 kHz, resampled by linear interpolation (ffmpeg's resampler
is better; a 16 kHz file is read exactly). Anything else is :class:`NotWav`.
"""

from __future__ import annotations

import struct
from typing import TYPE_CHECKING

from octo.errors import InvalidRequest

if TYPE_CHECKING:
    import numpy as np

PCM, FLOAT, EXTENSIBLE = 1, 3, 0xFFFE
# the first two bytes of WAVE_FORMAT_EXTENSIBLE's SubFormat GUID are the format tag (KSDATAFORMAT_SUBTYPE_PCM/FLOAT)
_SUBFORMAT_TAIL = bytes.fromhex("000000001000800000aa00389b71")


class NotWav(Exception):
    """The upload is not a WAV file this decoder reads (ffmpeg is needed for it)."""


def is_riff_wave(data: bytes) -> bool:
    return len(data) >= 12 and data[:4] == b"RIFF" and data[8:12] == b"WAVE"


def _chunks(data: bytes) -> tuple[bytes, memoryview]:
    """The ``fmt `` chunk's bytes and the ``data`` chunk's view (a ``data`` chunk cut short is read as far as it goes,
    as ffmpeg does)."""
    fmt = None
    pos, view = 12, memoryview(data)
    while pos + 8 <= len(data):
        cid, size = data[pos:pos + 4], struct.unpack_from("<I", data, pos + 4)[0]
        body = pos + 8
        if cid == b"fmt ":
            fmt = bytes(view[body:body + size])
        elif cid == b"data":
            if fmt is None:
                break
            return fmt, view[body:min(len(data), body + size)]
        pos = body + size + (size & 1)  # chunks are padded to an even size
    raise NotWav("a WAV file without a fmt and a data chunk")


def _format(fmt: bytes) -> tuple[int, int, int, int]:
    """(format tag, channels, sample rate, bits per sample), the extensible form's tag taken from its SubFormat."""
    if len(fmt) < 16:
        raise NotWav("a WAV fmt chunk shorter than 16 bytes")
    tag, channels, rate, _, _, bits = struct.unpack_from("<HHIIHH", fmt)
    if tag == EXTENSIBLE:
        if len(fmt) < 40 or fmt[26:40] != _SUBFORMAT_TAIL:
            raise NotWav("a WAVE_FORMAT_EXTENSIBLE file of another sub-format than PCM or float")
        tag = struct.unpack_from("<H", fmt, 24)[0]
    return tag, channels, rate, bits


def decode_wav(data: bytes, *, max_seconds: float, rate_out: int = 16000) -> np.ndarray:
    """Mono float32 samples at ``rate_out`` of a WAV upload; :class:`NotWav` for any other format or WAV coding,
    a 400 for audio longer than ``max_seconds`` or with no samples."""
    import numpy as np

    fmt, raw = _chunks(data)
    tag, channels, rate, bits = _format(fmt)
    kinds = {(PCM, 8): "u1", (PCM, 16): "<i2", (PCM, 32): "<i4", (FLOAT, 32): "<f4", (FLOAT, 64): "<f8"}
    if (tag, bits) not in kinds and (tag, bits) != (PCM, 24):
        raise NotWav(f"a WAV file of format {tag} with {bits}-bit samples")
    if not channels or not 1000 <= rate <= 768000:
        raise InvalidRequest(f"The WAV file declares {channels} channel(s) at {rate} Hz.", param="file")
    width = bits // 8 * channels
    frames = len(raw) // width
    if frames / rate > max_seconds:
        raise InvalidRequest(f"The audio is longer than the limit of {max_seconds:g} seconds (--max-audio-seconds).",
                             param="file")
    if frames == 0:
        raise InvalidRequest("The file contains no audio samples.", param="file")
    raw = raw[:frames * width]
    if bits == 24:  # three bytes a sample: widen to int32 (the sign from the top byte)
        b = np.frombuffer(raw, np.uint8).reshape(-1, 3).astype(np.int32)
        x = ((b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)) << 8 >> 8).astype(np.float32) / 2**23
    else:
        x = np.frombuffer(raw, kinds[tag, bits]).astype(np.float32)
        if tag == PCM:
            x = (x - 128.0) / 128.0 if bits == 8 else x / float(2 ** (bits - 1))
    x = x.reshape(frames, channels).mean(axis=1, dtype=np.float32)
    if rate != rate_out:
        n = max(1, round(frames * rate_out / rate))
        x = np.interp(np.arange(n) * (rate / rate_out), np.arange(frames), x).astype(np.float32)
    return np.ascontiguousarray(x, dtype=np.float32)
