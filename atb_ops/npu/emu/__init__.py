"""Pure-PyTorch emulations of the torch_npu ops the NPU backend calls, written from their documented semantics.

Sources (cited per function): the torch_npu API docs (Ascend/op-plugin ``docs/zh/custom_APIs/torch_npu``), the
CPU goldens of the op-plugin unit tests (``test/test_custom_ops``) and the schemas of the torch_npu wheel
(``torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml``). Every function takes the public keyword names of
the real op. An argument whose documented meaning this emulation does not implement raises
:class:`NotEmulated` instead of being ignored. Nothing here uses the reference backend: the NPU backend is
compared with the reference *through* these functions, so they must be an independent transcription.
"""

from .common import NotEmulated  # noqa: F401
