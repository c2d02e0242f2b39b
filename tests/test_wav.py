"""WAV uploads decoded by octo itself when the server has no ffmpeg (``octo.server.wav``)."""

from __future__ import annotations

import io
import struct
import wave

import numpy as np
import pytest

from octo.errors import InvalidRequest
from octo.server.wav import NotWav, decode_wav, is_riff_wave


def _pcm_wav(x: np.ndarray, rate: int = 16000, width: int = 2, channels: int = 1) -> bytes:
    """``x`` (float in [-1, 1], frames x channels) as integer PCM through the standard library's writer."""
    scale = {1: 127, 2: 32767, 3: 2**23 - 1, 4: 2**31 - 1}[width]
    ints = np.round(x.reshape(-1) * scale).astype(np.int64)
    if width == 1:
        raw = (ints + 128).astype(np.uint8).tobytes()
    else:
        raw = b"".join(int(v).to_bytes(width, "little", signed=True) for v in ints) if width == 3 else \
            ints.astype({2: "<i2", 4: "<i4"}[width]).tobytes()
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(width)
        w.setframerate(rate)
        w.writeframes(raw)
    return buf.getvalue()


def _float_wav(x: np.ndarray, rate: int = 16000, extensible: bool = False) -> bytes:
    data = x.astype("<f4").tobytes()
    if extensible:  # WAVE_FORMAT_EXTENSIBLE with the float sub-format
        fmt = struct.pack("<HHIIHHHHI", 0xFFFE, 1, rate, rate * 4, 4, 32, 22, 32, 4) + \
            struct.pack("<H", 3) + bytes.fromhex("000000001000800000aa00389b71")
    else:
        fmt = struct.pack("<HHIIHH", 3, 1, rate, rate * 4, 4, 32)
    body = b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", len(data)) + data
    return b"RIFF" + struct.pack("<I", len(body)) + body


TONE = (0.5 * np.sin(2 * np.pi * 440 * np.arange(16000) / 16000)).astype(np.float32)


def test_16_bit_mono_at_16_khz_is_read_exactly():
    out = decode_wav(_pcm_wav(TONE), max_seconds=30)
    assert out.dtype == np.float32 and out.shape == (16000,)
    assert np.max(np.abs(out - np.round(TONE * 32767) / 32768)) < 1e-6


@pytest.mark.parametrize("width", [1, 3, 4])
def test_8_24_and_32_bit_pcm(width):
    out = decode_wav(_pcm_wav(TONE, width=width), max_seconds=30)
    assert out.shape == (16000,) and np.max(np.abs(out - TONE)) < (0.02 if width == 1 else 1e-4)


@pytest.mark.parametrize("extensible", [False, True])
def test_float_samples_plain_and_extensible(extensible):
    out = decode_wav(_float_wav(TONE, extensible=extensible), max_seconds=30)
    assert np.array_equal(out, TONE)


def test_stereo_at_44_1_khz_is_averaged_and_resampled():
    t = np.arange(44100) / 44100
    left = 0.5 * np.sin(2 * np.pi * 440 * t)
    stereo = np.stack([left, left], axis=1)
    out = decode_wav(_pcm_wav(stereo, rate=44100, channels=2), max_seconds=30)
    assert out.shape == (16000,)
    assert np.max(np.abs(out - TONE)) < 0.01  # the same tone at 16 kHz


def test_too_long_empty_and_other_formats():
    with pytest.raises(InvalidRequest, match="longer than the limit of 0.5 seconds"):
        decode_wav(_pcm_wav(TONE), max_seconds=0.5)
    with pytest.raises(InvalidRequest, match="no audio samples"):
        decode_wav(_pcm_wav(TONE[:0]), max_seconds=30)
    alaw = bytearray(_pcm_wav(TONE))
    alaw[20:22] = struct.pack("<H", 6)  # format tag 6: A-law, which only ffmpeg decodes
    with pytest.raises(NotWav, match="format 6"):
        decode_wav(bytes(alaw), max_seconds=30)
    assert not is_riff_wave(b"ID3\x03" + b"\0" * 64) and is_riff_wave(_pcm_wav(TONE))
