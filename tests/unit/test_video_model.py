"""Loading video models (presets and Diffusers directories) and the denoising loop against diffusers' WanPipeline."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from diffusers import WanPipeline

from omnigate.engines.video.denoise import Denoiser, encode_prompt, initial_latents, to_unit_range
from omnigate.engines.video.engine import VideoEngine
from omnigate.engines.video.model import (
    ModelSpecError,
    VideoModel,
    build_preset,
    load_video_model,
    save_directory,
)
from omnigate.engines.video.outputs import FrameGroup, VideoDone
from omnigate.engines.video.request import VideoOptions, VideoRequest
from omnigate.engines.video.tokenizer import BYTE_OFFSET, EOS_ID, PAD_ID, byte_level_tokenizer
from omnigate.engines.video.vae_stream import StreamingVaeDecoder


@pytest.fixture(scope="module")
def model() -> VideoModel:
    return build_preset("tiny", seed=3)


def generate(model: VideoModel, request: VideoRequest) -> np.ndarray:
    engine = VideoEngine(model, VideoOptions(max_frames_in_flight=64))
    engine.start()
    try:
        job = engine.submit(request)
        frames = []
        while not isinstance(output := job.wait_output(timeout=60), VideoDone):
            assert isinstance(output, FrameGroup)
            frames.append(output.frames)
            job.consumed(output.count)
        assert output.status == "completed"
        return np.concatenate(frames)
    finally:
        engine.stop()


@torch.no_grad()
def test_denoising_and_streamed_decoding_equal_wan_pipeline_exactly(model: VideoModel) -> None:
    width, height, frames, steps, seed, prompt = 64, 48, 9, 3, 7, "a red fox &amp; a  hare"
    pipeline: Any = WanPipeline(
        tokenizer=model.tokenizer,
        text_encoder=model.text_encoder,
        vae=model.vae,
        scheduler=model.scheduler,
        transformer=model.transformer,
    )
    pipeline.set_progress_bar_config(disable=True)
    reference = pipeline(
        prompt=prompt,
        negative_prompt="",
        height=height,
        width=width,
        num_frames=frames,
        num_inference_steps=steps,
        guidance_scale=5.0,
        generator=torch.Generator("cpu").manual_seed(seed),
        output_type="np",
        max_sequence_length=model.max_sequence_length,
    ).frames[0]
    denoiser = Denoiser(
        model,
        initial_latents(model, width=width, height=height, num_frames=frames, seed=seed),
        encode_prompt(model, prompt),
        encode_prompt(model, ""),
        steps=steps,
        guidance_scale=5.0,
    )
    while not denoiser.done:
        denoiser.step()
    latents = denoiser.vae_latents()
    decoder = StreamingVaeDecoder(model.vae)
    video = torch.cat([decoder.decode(latents[:, :, i : i + 1]) for i in range(latents.shape[2])], dim=2)
    ours = to_unit_range(video)[0].permute(1, 2, 3, 0).numpy()
    assert ours.shape == reference.shape == (9, 48, 64, 3)
    assert np.array_equal(ours, reference)


def test_a_saved_directory_loads_back_and_generates_the_same_video(model: VideoModel, tmp_path: Path) -> None:
    save_directory(model, tmp_path)
    assert (tmp_path / "model_index.json").is_file()
    loaded = load_video_model(str(tmp_path), max_sequence_length=model.max_sequence_length)
    assert not loaded.random_weights
    assert loaded.name == str(tmp_path)
    assert type(loaded.scheduler) is type(model.scheduler)
    request = VideoRequest(prompt="a lighthouse", width=32, height=32, num_frames=5, fps=8, steps=2, seed=5)
    # Same weights, read back from safetensors: equal up to float rounding (a few pixels one level apart).
    difference = np.abs(generate(loaded, request).astype(np.int16) - generate(model, request))
    assert difference.max() <= 1
    assert difference.mean() < 0.01


def test_model_specs_that_name_nothing_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ModelSpecError, match="preset"):
        load_video_model("preset:nope")
    with pytest.raises(ModelSpecError, match=r"model_index\.json"):
        load_video_model(str(tmp_path))
    with pytest.raises(ModelSpecError, match="neither"):
        load_video_model(str(tmp_path / "missing"))
    with pytest.raises(ModelSpecError):
        load_video_model(None)


def test_low_precision_keeps_wans_float32_modules() -> None:
    model = build_preset("tiny", dtype="bfloat16")
    transformer = model.transformer
    assert transformer.patch_embedding.weight.dtype == torch.bfloat16
    assert transformer.scale_shift_table.dtype == torch.float32
    assert transformer.condition_embedder.time_embedder.linear_1.weight.dtype == torch.float32
    assert model.dtype == torch.bfloat16
    assert next(model.vae.parameters()).dtype == torch.float32


def test_the_byte_tokenizer_speaks_umt5s_special_ids(tmp_path: Path) -> None:
    tokenizer = byte_level_tokenizer()
    encoded = tokenizer(["hé"], padding="max_length", max_length=6, add_special_tokens=True, return_tensors="pt")
    assert encoded.input_ids.tolist() == [
        [BYTE_OFFSET + ord("h"), BYTE_OFFSET + 0xC3, BYTE_OFFSET + 0xA9, EOS_ID] + [PAD_ID] * 2
    ]
    assert encoded.attention_mask.tolist() == [[1, 1, 1, 1, 0, 0]]
