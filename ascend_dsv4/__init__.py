"""ascend-dsv4: serve DeepSeek-V4 (Flash, Pro) and DeepSeek-V3/R1 on Huawei Ascend NPUs.

Quick start (CPU, the embedded toy model)::

    from ascend_dsv4 import LLM, SamplingParams
    llm = LLM(model="toy-v4")
    print(llm.generate("Hello", SamplingParams(max_tokens=16, temperature=0))[0].text)
"""

from .engine.sampling import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "load_config", "__version__"]


def __getattr__(name):  # import the model stack lazily: `import ascend_dsv4` stays cheap
    if name == "LLM":
        from .entrypoints.llm import LLM

        return LLM
    if name == "load_config":
        from .models import load_config

        return load_config
    raise AttributeError(name)
