"""The talker's own forward over slot caches matches transformers' CSM, and checkpoints load from a directory."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from omnigate.engines.base import AudioChunk, SynthesisParams
from omnigate.engines.registry import load_engine
from omnigate.engines.talker.engine import TalkerEngine
from omnigate.engines.talker.frames import FrameModel
from omnigate.engines.talker.model import PRESETS, ModelSpecError, TalkerModel, build_preset, load_talker_model
from omnigate.engines.talker.sampling import TokenSampler


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread() -> Iterator[None]:
    """Small tensors run fastest on one thread, and a shared CPU makes extra threads spin."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def greedy_frames(model: TalkerModel, *, slots: int = 4) -> FrameModel:
    sampler = TokenSampler(temperature=0.0, top_k=0, valid_ids=2051, eos_id=0, eos_bias=0.0)
    return FrameModel(model, max_slots=slots, max_batch=slots, capacity=128, sampler=sampler)


@pytest.fixture(scope="module")
def tiny64() -> TalkerModel:
    model = build_preset("tiny", seed=3)
    model.csm.to(torch.float64)
    return model


def test_slot_forward_equals_reference_logits_while_other_slots_are_busy(tiny64: TalkerModel) -> None:
    frames = greedy_frames(tiny64)
    ids = tiny64.segments.encode("0", "Slots hold streams.")
    gen = torch.Generator().manual_seed(0)
    audio = torch.randint(0, 2048, (5, 8), generator=gen)
    with torch.no_grad():
        text = frames.embed_text(ids)
        sequence = torch.cat((text, frames.embed_frames(audio)))
        backbone = tiny64.csm.backbone_model(inputs_embeds=sequence[None]).last_hidden_state
        reference = tiny64.csm.lm_head(backbone)[0]
        frames.extend(0, frames.embed_text([5, 6, 7]))  # other streams at other lengths
        frames.extend(3, frames.embed_text([9] * 11))
        hidden = [frames.extend(2, text[:4]), frames.extend(2, text[4:])]
        for k in range(audio.shape[0]):
            hidden.append(frames.advance([3, 2, 0], torch.stack((audio[0], audio[k], audio[1])))[1:2])
    ours = frames.codebook0_logits(torch.cat(hidden))
    positions = [3, len(ids) - 1, *range(len(ids), len(ids) + audio.shape[0])]
    torch.testing.assert_close(ours, reference[positions], rtol=0, atol=1e-10)


def test_greedy_frames_equal_transformers_generate(tiny64: TalkerModel) -> None:
    frames = greedy_frames(tiny64)
    ids = tiny64.segments.encode("1", "Same frames as the reference.")
    with torch.no_grad():
        reference = tiny64.csm.generate(
            input_ids=torch.tensor([ids]), do_sample=False, depth_decoder_do_sample=False, max_new_tokens=5
        )[0]
    zeros = torch.zeros(1, dtype=torch.long)
    ours = []
    with torch.no_grad():
        frame = frames.sample(frames.extend(1, frames.embed_text(ids)), zeros, zeros)
        for _ in range(5):
            ours.append(frame[0])
            frame = frames.sample(frames.advance([1], frame), zeros, zeros)
    assert torch.equal(torch.stack(ours), reference)


def pcm_of(engine: TalkerEngine, text: str, *, seed: int) -> bytes:
    stream = engine.open(SynthesisParams(voice="0", max_audio_ms=400), seed=seed)
    stream.pending_text.append(text)
    stream.input_done = True
    pcm = b""
    while stream.has_work:
        for item in engine.step([stream], [1e9])[0]:
            if isinstance(item, AudioChunk):
                pcm += item.pcm
    return pcm


def test_checkpoint_directory_loads_back_through_model_path(tmp_path: Path) -> None:
    preset = build_preset("tiny", seed=5)
    preset.csm.save_pretrained(tmp_path)
    preset.tokenizer.save_pretrained(tmp_path)
    loaded = load_talker_model(str(tmp_path))
    assert not loaded.random_weights
    assert loaded.segments.encode("0", "hé") == preset.segments.encode("0", "hé")
    for (name, ours), (_, theirs) in zip(loaded.csm.state_dict().items(), preset.csm.state_dict().items(), strict=True):
        assert torch.equal(ours, theirs), name
    engine = load_engine("talker", str(tmp_path), max_sessions="2", max_batch="2", dtype="float64")
    assert isinstance(engine, TalkerEngine)
    assert engine.info.model == str(tmp_path) and not engine.info.synthetic
    reference = TalkerEngine(build_preset("tiny", seed=5), engine.options)
    assert pcm_of(engine, "Loaded.", seed=9) == pcm_of(reference, "Loaded.", seed=9)


def test_codec_may_sit_next_to_the_checkpoint(tmp_path: Path) -> None:
    preset = build_preset("tiny", seed=6)
    preset.csm.save_pretrained(tmp_path)
    preset.tokenizer.save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    save_file({k: v for k, v in weights.items() if not k.startswith("codec_model.")}, tmp_path / "model.safetensors")
    with pytest.raises(ModelSpecError, match="no Mimi weights"):
        load_talker_model(str(tmp_path))
    preset.csm.codec_model.save_pretrained(tmp_path / "mimi")
    loaded = load_talker_model(str(tmp_path))
    for (name, ours), (_, theirs) in zip(
        loaded.csm.codec_model.state_dict().items(), preset.csm.codec_model.state_dict().items(), strict=True
    ):
        assert torch.equal(ours, theirs), name


@pytest.mark.parametrize("spec", [None, "preset:huge", "/nonexistent/csm"])
def test_bad_model_specs_are_refused(spec: str | None) -> None:
    with pytest.raises(ModelSpecError):
        load_talker_model(spec)


def test_csm_1b_preset_has_the_published_dimensions() -> None:
    config = PRESETS["csm-1b"]()
    depth: Any = config.depth_decoder_config
    codec: Any = config.codec_config
    backbone = (config.hidden_size, config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads)
    assert backbone == (2048, 16, 32, 8) and config.intermediate_size == 8192
    assert (config.num_codebooks, config.vocab_size, config.text_vocab_size) == (32, 2051, 128256)
    assert (depth.hidden_size, depth.num_hidden_layers, depth.num_attention_heads, depth.num_key_value_heads) == (
        1024,
        4,
        8,
        2,
    )
    assert (codec.num_quantizers, codec.sampling_rate, codec.frame_rate) == (32, 24000, 12.5)
