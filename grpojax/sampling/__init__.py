"""Group-aware generation: shared prefill, KV-cache decode loop, sampling strategies."""

from grpojax.sampling.sampler import SampleOutput, bucket_length, generate, generate_from_params
from grpojax.sampling.strategies import SamplingParams
