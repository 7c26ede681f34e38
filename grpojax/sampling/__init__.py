"""Group-aware generation: shared prefill, KV-cache decode loop, sampling strategies."""

from grpojax import lazy

__getattr__, __dir__, __all__ = lazy.attach(__name__, {
    "sampler": ["SampleOutput", "bucket_length", "generate", "generate_from_params"],
    "strategies": ["SamplingParams"],
})
