"""Text-to-video with a Wan 2.1-shaped diffusion model and a streaming causal VAE decoder.

Model code (presets, loading, the denoising loop, the streaming VAE decoder) needs only torch, diffusers and
transformers; the serving engine on top of it is :mod:`omnigate.engines.video.engine`.
"""
