"""The policy engine: the engine contract (``open`` / ``step`` / ``close``) for robot policies.

A stream is one robot session. The scheduler (:mod:`omnigate.engines.policy.pool`) sets a stream's observation and
calls :meth:`PolicyEngine.step` with the streams it batches; each step runs every observation of the batch through
one flow-matching sampling (prefix once, then ``flow_steps`` passes of the action expert) and returns one action
chunk per stream. pi0 keeps no state between observations, so ``open`` and ``close`` hold nothing.

Observation transforms run here, not in the route: each image is resized with padding to the model's square size
(aspect kept, black bars, as LeRobot's pi0 does) and scaled to [-1, 1] on the device; the state is normalized with
the checkpoint's statistics and zero-padded to ``max_state_dim``; the prompt becomes byte tokens. Actions are
un-normalized and cut to the robot's ``action_dim``.

On a GPU the sampling of each batch-size bucket is one CUDA graph, captured at load: a step copies the batch into
the bucket's static inputs and replays it, so a step costs one launch whatever the number of layers and flow steps.
The layers run fused (merged projections, one-kernel norms, residual adds inside the output GEMMs; see
:meth:`~omnigate.engines.policy.model.Pi0Policy.pack`), which halves the kernels of a step, and most of a small
batch's step is kernels too small to fill the GPU; ``fused=off`` serves the reference layers, the same function.
With ``state_cache`` (the default) the state token's keys and values are computed once per observation and each flow
step runs the action tokens alone over the expert's caches: on CUDA one Triton kernel rotates and writes their keys
and values, and a split-KV Triton kernel attends over the cache (:mod:`omnigate.kernels.prefix_attention`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from omnigate.engines.base import EngineError
from omnigate.engines.policy.checkpoint import Normalization, load_checkpoint
from omnigate.engines.policy.model import Pi0Dims, Pi0Policy, build_random, pi0_dims, tiny_dims
from omnigate.engines.policy.spec import Observation, PolicyInfo, PolicyResult, PolicyStream

log = logging.getLogger(__name__)

FAMILY = "policy"
PRESETS = {"tiny": tiny_dims, "pi0": pi0_dims}
DEFAULT_CONTROL_RATE_HZ = {"tiny": 10.0, "pi0": 50.0}  # pi0's robots run at 50 Hz (its paper, ALOHA and others)
STATE_KEY = "observation/state"
PROMPT_KEY = "prompt"
_BOS, _BYTE_OFFSET = 2, 3  # token ids: 0 pad, 2 beginning of prompt, 3 + byte value for each byte


def preset_image_keys(cameras: int) -> tuple[str, ...]:
    """openpi's LIBERO names for the first two cameras, numbered names after them."""
    names = ["observation/image", "observation/wrist_image"]
    return tuple(names[i] if i < len(names) else f"observation/image_{i}" for i in range(cameras))


class PolicyEngine:
    """A loaded policy shared by all robot sessions."""

    def __init__(
        self,
        policy: Pi0Policy,
        *,
        model_name: str,
        random_weights: bool,
        image_keys: tuple[str, ...],
        state_dim: int,
        action_dim: int,
        normalization: Normalization,
        control_rate_hz: float,
        max_sessions: int,
        max_batch: int,
        graphs: bool,
        fused: bool = True,
        state_cache: bool = True,
        seed: int = 0,
    ) -> None:
        self.policy = policy
        self.fused = fused
        self.state_cache = fused and state_cache  # the cache runs on the fused layers
        if fused and not policy.packed:
            policy.pack()
        self.dims: Pi0Dims = policy.dims
        parameter = next(policy.parameters())
        self.device, self.dtype = parameter.device, parameter.dtype
        self.image_size = int(self.dims.vision["image_size"])
        self.vocab_size = int(self.dims.backbone["vocab_size"])
        self.normalization = normalization
        self.info = PolicyInfo(
            model=model_name,
            random_weights=random_weights,
            image_keys=image_keys,
            state_key=STATE_KEY,
            prompt_key=PROMPT_KEY,
            image_size=self.image_size,
            state_dim=state_dim,
            max_state_dim=self.dims.max_state_dim,
            action_horizon=self.dims.action_horizon,
            action_dim=action_dim,
            flow_steps=self.dims.flow_steps,
            control_rate_hz=control_rate_hz,
            max_sessions=max_sessions,
            max_batch=max_batch,
            device=str(self.device),
        )
        self._generator = torch.Generator(device=self.device).manual_seed(seed)
        self._graphs: dict[int, _GraphedSampler] = {}
        self._lock = threading.Lock()  # the model is not re-entrant; one step at a time
        if graphs and self.device.type == "cuda":
            self._capture()

    # ---- loading ------------------------------------------------------------------------------------------------

    @classmethod
    def load(cls, spec: str | None, **options: Any) -> PolicyEngine:
        """``preset:tiny``, ``preset:pi0`` (random weights) or a LeRobot pi0 checkpoint directory.

        Options: ``device`` (cpu, cuda, cuda:N; default cuda when available for pi0, else cpu), ``dtype``
        (float32, bfloat16; default bfloat16 on a GPU), ``cameras`` (presets), ``max_batch``, ``max_sessions``,
        ``control_rate_hz`` (the rate a session is assumed to run at before it is measured or declared),
        ``flow_steps``, ``graphs`` (on/off: CUDA graphs on a GPU), ``fused`` (on/off: the merged-weight layers, or the
        reference layers one projection at a time), ``state_cache`` (on/off, with ``fused``: the state token's keys
        and values computed once per observation and the action tokens' attention over the cache, or the state token
        recomputed at every flow step under one mask), ``seed``, ``threads`` (CPU).
        """
        spec = spec or "preset:tiny"
        unknown = set(options) - {
            "device", "dtype", "cameras", "max_batch", "max_sessions", "control_rate_hz", "flow_steps", "graphs",
            "fused", "state_cache", "seed", "threads",
        }  # fmt: skip
        if unknown:
            raise ValueError(f"unknown robot model option(s): {', '.join(sorted(unknown))}")
        preset = spec.removeprefix("preset:") if spec.startswith("preset:") else None
        if preset is not None and preset not in PRESETS:
            raise ValueError(f"unknown robot preset {preset!r}; choose one of {', '.join(PRESETS)}")
        default_device = "cuda" if preset != "tiny" and torch.cuda.is_available() else "cpu"
        device = torch.device(str(options.get("device", default_device)))
        dtype_name = str(options.get("dtype", "bfloat16" if device.type == "cuda" else "float32"))
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(dtype_name)
        if dtype is None:
            raise ValueError(f"dtype must be float32, bfloat16 or float16, not {dtype_name!r}")
        if "threads" in options:
            torch.set_num_threads(int(options["threads"]))
        seed = int(options.get("seed", 0))
        if preset is not None:
            dims = PRESETS[preset](int(options.get("cameras", 2)))
            if "flow_steps" in options:
                dims = _with_flow_steps(dims, int(options["flow_steps"]))
            policy = build_random(dims, device, dtype, seed)
            image_keys, state_dim, action_dim = preset_image_keys(dims.cameras), 8, 7
            normalization, name, random_weights = Normalization(), f"preset:{preset}", True
            rate = DEFAULT_CONTROL_RATE_HZ[preset]
        else:
            checkpoint = load_checkpoint(Path(spec), device, dtype)
            policy = checkpoint.policy
            if "flow_steps" in options:
                policy.dims = _with_flow_steps(policy.dims, int(options["flow_steps"]))
            image_keys, state_dim, action_dim = checkpoint.image_keys, checkpoint.state_dim, checkpoint.action_dim
            normalization, name, random_weights = checkpoint.normalization, Path(spec).name, False
            rate = 50.0
        max_batch = int(options.get("max_batch", 64 if device.type == "cuda" else 32))
        return cls(
            policy,
            model_name=name,
            random_weights=random_weights,
            image_keys=image_keys,
            state_dim=state_dim,
            action_dim=action_dim,
            normalization=normalization,
            control_rate_hz=float(options.get("control_rate_hz", rate)),
            max_sessions=int(options.get("max_sessions", 256)),
            max_batch=max_batch,
            graphs=_switch(options.get("graphs", "on")),
            fused=_switch(options.get("fused", "on")),
            state_cache=_switch(options.get("state_cache", "on")),
            seed=seed,
        )

    # ---- the engine contract ----------------------------------------------------------------------------------------

    def open(self) -> PolicyStream:
        """Create one session's state (none for pi0 beyond its pending observation). Cheap."""
        return PolicyStream()

    def close(self, stream: PolicyStream) -> None:
        """Release the session's state. Idempotent."""
        stream.observation = None

    def step(self, streams: Sequence[PolicyStream]) -> list[PolicyResult]:
        """One action chunk for each stream's observation, all sampled in one batched pass."""
        observations = []
        for stream in streams:
            if stream.observation is None:
                raise EngineError("engine_error", "a stream was stepped without an observation")
            observations.append(stream.observation)
        with self._lock, torch.inference_mode():
            started = time.perf_counter()
            actions = self._sample(observations)
            infer_ms = (time.perf_counter() - started) * 1000.0
        return [PolicyResult(actions=a, infer_ms=infer_ms, batch_size=len(streams)) for a in actions]

    def shutdown(self) -> None:
        self._graphs.clear()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    # ---- transforms and sampling ---------------------------------------------------------------------------------

    def _image(self, image: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        """Resize with padding to the model's square size, keeping the aspect ratio (uint8 HxWx3 in and out)."""
        size = self.image_size
        height, width = image.shape[:2]
        if height == size and width == size:
            return image
        scale = size / max(height, width)
        new_h, new_w = max(1, round(height * scale)), max(1, round(width * scale))
        tensor = torch.from_numpy(np.array(image)).permute(2, 0, 1)[None].float()  # a copy: wire arrays are read-only
        resized = F.interpolate(tensor, size=(new_h, new_w), mode="bilinear", antialias=True, align_corners=False)
        out = np.zeros((size, size, 3), dtype=np.uint8)
        top, left = (size - new_h) // 2, (size - new_w) // 2
        out[top : top + new_h, left : left + new_w] = resized[0].permute(1, 2, 0).round().clamp(0, 255).byte().numpy()
        return out

    def _tokens(self, prompt: str) -> list[int]:
        # Byte tokens wrapped into the vocabulary: the presets have no trained tokenizer (see the docs' limits).
        ids = [_BOS] + [_BYTE_OFFSET + b for b in (prompt.strip() + "\n").encode()]
        return [i % self.vocab_size for i in ids[: self.dims.max_prompt_tokens]]

    def _inputs(self, observations: Sequence[Observation]) -> dict[str, torch.Tensor]:
        """The batch as host tensors: uint8 images (B, cameras, S, S, 3), tokens, mask, normalized padded state."""
        b, dims = len(observations), self.dims
        images = np.stack([np.stack([self._image(img) for img in obs.images]) for obs in observations])
        tokens = torch.zeros(b, dims.max_prompt_tokens, dtype=torch.long)
        mask = torch.zeros(b, dims.max_prompt_tokens, dtype=torch.bool)
        state = torch.zeros(b, dims.max_state_dim, dtype=torch.float32)
        norm = self.normalization
        for i, obs in enumerate(observations):
            ids = self._tokens(obs.prompt)
            tokens[i, : len(ids)] = torch.tensor(ids)
            mask[i, : len(ids)] = True
            values = torch.from_numpy(obs.state)
            if norm.state_mean is not None and norm.state_std is not None:
                n = values.shape[0]
                values = (values - norm.state_mean[:n].cpu()) / (norm.state_std[:n].cpu() + 1e-8)
            state[i, : values.shape[0]] = values
        return {"images": torch.from_numpy(images), "tokens": tokens, "mask": mask, "state": state}

    def _sample(self, observations: Sequence[Observation]) -> list[np.ndarray[Any, Any]]:
        inputs = self._inputs(observations)
        b = len(observations)
        bucket = next((size for size in sorted(self._graphs) if size >= b), None)
        if bucket is not None:
            raw = self._graphs[bucket].run(inputs, self._generator)[:b]
        else:
            noise = torch.randn(
                b, self.dims.action_horizon, self.dims.max_action_dim, device=self.device, dtype=self.dtype,
                generator=self._generator,
            )  # fmt: skip
            device_inputs = {k: v.to(self.device, non_blocking=True) for k, v in inputs.items()}
            raw = self.policy.sample_actions(
                _pixels(device_inputs["images"], self.dtype),
                device_inputs["tokens"],
                device_inputs["mask"],
                device_inputs["state"].to(self.dtype),
                noise,
                self.fused,
                self.state_cache,
            )
        actions = raw[:, :, : self.info.action_dim].float().cpu()
        norm = self.normalization
        if norm.action_mean is not None and norm.action_std is not None:
            dim = self.info.action_dim
            actions = actions * norm.action_std[:dim].cpu() + norm.action_mean[:dim].cpu()
        return list(actions.numpy())

    def _capture(self) -> None:
        """One CUDA graph per batch-size bucket (powers of two up to ``max_batch``), captured from a warm model."""
        started = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        size = 1
        buckets = []
        while size < self.info.max_batch:
            buckets.append(size)
            size *= 2
        buckets.append(self.info.max_batch)
        try:
            with torch.inference_mode():
                for bucket in reversed(buckets):  # the largest first: the smaller ones reuse its memory pool
                    self._graphs[bucket] = _GraphedSampler(
                        self.policy, bucket, self.dims, self.dtype, pool, self.fused, self.state_cache
                    )
        except RuntimeError:
            # A kernel that cannot be captured must not take the policy down: it is served eagerly, and said so.
            log.exception("policy CUDA graphs could not be captured; stepping eagerly")
            self._graphs.clear()
            torch.cuda.synchronize()
            return
        log.info("policy graphs for batches %s captured in %.1f s", buckets, time.perf_counter() - started)

    @property
    def graph_batches(self) -> tuple[int, ...]:
        """The batch sizes served by a CUDA graph (none on a CPU or when capture failed)."""
        return tuple(sorted(self._graphs))


def _pixels(images: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """uint8 (B, cameras, S, S, 3) to (B, cameras, 3, S, S) in [-1, 1]."""
    return (images.permute(0, 1, 4, 2, 3).to(dtype) / 127.5 - 1.0).contiguous()


def _switch(value: object) -> bool:
    return str(value).lower() not in ("off", "0", "false", "no")


def _with_flow_steps(dims: Pi0Dims, steps: int) -> Pi0Dims:
    if steps < 1:
        raise ValueError("flow_steps must be at least 1")
    return replace(dims, flow_steps=steps)


class _GraphedSampler:
    """``sample_actions`` for a fixed batch size as one CUDA graph with static inputs and output."""

    def __init__(
        self,
        policy: Pi0Policy,
        batch: int,
        dims: Pi0Dims,
        dtype: torch.dtype,
        pool: Any,
        fused: bool,
        state_cache: bool,
    ) -> None:
        device = next(policy.parameters()).device
        size, cameras = int(dims.vision["image_size"]), dims.cameras
        self.batch = batch
        self.images = torch.zeros(batch, cameras, size, size, 3, dtype=torch.uint8, device=device)
        self.tokens = torch.zeros(batch, dims.max_prompt_tokens, dtype=torch.long, device=device)
        self.mask = torch.zeros(batch, dims.max_prompt_tokens, dtype=torch.bool, device=device)
        self.mask[:, 0] = True  # padding rows attend to something: no all-masked softmax
        self.state = torch.zeros(batch, dims.max_state_dim, dtype=torch.float32, device=device)
        self.noise = torch.zeros(batch, dims.action_horizon, dims.max_action_dim, dtype=dtype, device=device)

        def run() -> torch.Tensor:
            return policy.sample_actions(
                _pixels(self.images, dtype),
                self.tokens,
                self.mask,
                self.state.to(dtype),
                self.noise,
                fused,
                state_cache,
            )

        stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                run()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.output = run()

    def run(self, inputs: dict[str, torch.Tensor], generator: torch.Generator) -> torch.Tensor:
        b = inputs["images"].shape[0]
        self.images[:b].copy_(inputs["images"], non_blocking=True)
        self.tokens[:b].copy_(inputs["tokens"], non_blocking=True)
        self.mask[:b].copy_(inputs["mask"], non_blocking=True)
        self.state[:b].copy_(inputs["state"], non_blocking=True)
        self.noise.normal_(generator=generator)
        self.graph.replay()
        return self.output
