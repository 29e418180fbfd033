"""Robot policies (pi0-style vision-language-action models) served to many robots on one batched model."""
