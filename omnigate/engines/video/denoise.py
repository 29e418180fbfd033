"""Wan 2.1 text-to-video generation in steps: prompt encoding, the denoising loop, and latents ready for the VAE.

The arithmetic is ``WanPipeline.__call__``'s (same prompt padding, same classifier-free guidance, same scheduler
calls, same latent de-normalisation), cut so that a worker thread runs one denoising step at a time and can
interleave generations or stop one between steps. A test holds it equal to ``WanPipeline`` output.
"""

from __future__ import annotations

import html
import re
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from omnigate.engines.video.model import VideoModel

_WHITESPACE = re.compile(r"\s+")


def clean_prompt(text: str) -> str:
    """Wan's prompt clean-up (HTML entities unescaped twice, whitespace collapsed), without the optional ftfy pass."""
    return _WHITESPACE.sub(" ", html.unescape(html.unescape(text)).strip()).strip()


@torch.no_grad()
def encode_prompt(model: VideoModel, prompt: str) -> torch.Tensor:
    """UMT5 embeddings ``(1, max_sequence_length, text_dim)``: the prompt's tokens, then zeros (Wan's padding)."""
    length = model.max_sequence_length
    tokens = model.tokenizer(
        [clean_prompt(prompt)],
        padding="max_length",
        max_length=length,
        truncation=True,
        add_special_tokens=True,
        return_attention_mask=True,
        return_tensors="pt",
    )
    device = model.text_encoder.device
    ids, mask = tokens.input_ids.to(device), tokens.attention_mask.to(device)
    used = int(mask.gt(0).sum())
    hidden: torch.Tensor = model.text_encoder(ids, mask).last_hidden_state
    hidden = hidden.to(dtype=model.text_encoder.dtype, device=model.device)[0, :used]
    padded = torch.cat([hidden, hidden.new_zeros(length - used, hidden.shape[1])])
    return padded.unsqueeze(0).to(model.dtype)


def initial_latents(model: VideoModel, *, width: int, height: int, num_frames: int, seed: int) -> torch.Tensor:
    """Gaussian noise ``(1, C, T, h, w)`` in float32, drawn on the CPU so a seed gives the same video on any device."""
    scale = model.spatial_scale
    shape = (1, model.latent_channels, model.latent_frames(num_frames), height // scale, width // scale)
    generator = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randn(shape, generator=generator, dtype=torch.float32).to(model.device)


class Denoiser:
    """The denoising loop of one generation; :meth:`step` runs one scheduler step (one or two transformer calls)."""

    def __init__(
        self,
        model: VideoModel,
        latents: torch.Tensor,
        prompt_embeds: torch.Tensor,
        negative_embeds: torch.Tensor | None,
        *,
        steps: int,
        guidance_scale: float,
    ) -> None:
        if guidance_scale > 1.0 and negative_embeds is None:
            raise ValueError("classifier-free guidance needs the negative prompt's embeddings")
        self.model = model
        self.latents = latents
        self.prompt_embeds = prompt_embeds
        self.negative_embeds = negative_embeds if guidance_scale > 1.0 else None
        self.guidance_scale = guidance_scale
        # Schedulers keep per-generation state (step index, multistep history): one copy per generation.
        scheduler: Any = type(model.scheduler).from_config(model.scheduler.config)
        scheduler.set_timesteps(steps, device=model.device)
        scheduler.set_begin_index(0)
        self.scheduler = scheduler
        self.timesteps: torch.Tensor = scheduler.timesteps
        self.steps_done = 0

    @property
    def total_steps(self) -> int:
        return len(self.timesteps)

    @property
    def done(self) -> bool:
        return self.steps_done >= self.total_steps

    @torch.no_grad()
    def step(self) -> None:
        if self.done:
            raise RuntimeError("denoising is already complete")
        transformer = self.model.transformer
        t = self.timesteps[self.steps_done]
        model_input = self.latents.to(transformer.dtype)
        timestep = t.expand(self.latents.shape[0])
        noise: torch.Tensor = transformer(
            hidden_states=model_input, timestep=timestep, encoder_hidden_states=self.prompt_embeds, return_dict=False
        )[0]
        if self.negative_embeds is not None:
            uncond: torch.Tensor = transformer(
                hidden_states=model_input,
                timestep=timestep,
                encoder_hidden_states=self.negative_embeds,
                return_dict=False,
            )[0]
            noise = uncond + self.guidance_scale * (noise - uncond)
        self.latents = self.scheduler.step(noise, t, self.latents, return_dict=False)[0]
        self.steps_done += 1

    def vae_latents(self) -> torch.Tensor:
        """The denoised latents de-normalised for the VAE, on its device and in its dtype."""
        return vae_latents(self.model, self.latents)


def vae_latents(model: VideoModel, latents: torch.Tensor) -> torch.Tensor:
    """Denoised latents de-normalised for the VAE, on its device and in its dtype."""
    vae = model.vae
    latents = latents.to(vae.device, dtype=vae.dtype)
    channels = int(vae.config.z_dim)
    mean = torch.tensor(vae.config.latents_mean).view(1, channels, 1, 1, 1).to(latents.device, latents.dtype)
    inverse_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, channels, 1, 1, 1).to(
        latents.device, latents.dtype
    )
    return latents / inverse_std + mean  # written as WanPipeline writes it, so the rounding matches


def to_unit_range(video: torch.Tensor) -> torch.Tensor:
    """VAE output in [-1, 1] → [0, 1], as diffusers' video post-processing does."""
    return (video / 2 + 0.5).clamp(0, 1)


def to_rgb_frames(video: torch.Tensor) -> npt.NDArray[np.uint8]:
    """``(1, 3, f, H, W)`` VAE output → ``(f, H, W, 3)`` uint8 RGB on the CPU (converted on the device first: the
    copy is then a quarter of the float32 size)."""
    unit = torch.nan_to_num(to_unit_range(video[0].float()))
    pixels = (unit * 255).round().to(torch.uint8).permute(1, 2, 3, 0).contiguous()
    frames: npt.NDArray[np.uint8] = pixels.cpu().numpy()
    return frames
