"""Group-aware generation: shared prefill, KV-cache decode loop, sampling strategies."""

from grpojax.sampling.sampler import SampleOutput, bucket_length, generate
from grpojax.sampling.strategies import SamplingParams
