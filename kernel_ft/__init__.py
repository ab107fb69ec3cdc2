"""
kernel_ft: the fused Triton kernels of this tutorial in your own training script.

    import kernel_ft
    model = AutoModelForCausalLM.from_pretrained(...)   # (and get_peft_model(...) for LoRA)
    report = kernel_ft.apply(model)                     # every kernel that computes the model's function
    print(report)                                       # what went in, what did not and why
    trainer = Trainer(model=model, args=..., optimizers=(kernel_ft.AdamW(model.parameters(), lr=2e-5), None))

With labels, training calls return the loss without logits; an evaluation (eval mode,
no gradients) returns the logits too, for compute_metrics. ``with kernel_ft.loss_only():``
around an evaluation that needs only the loss skips them there as well.

``apply`` is kernel_ft/patching.py; ``AdamW`` the fused AdamW of adamw_kernel.py (the
signature and defaults of torch.optim.AdamW). The rest of the package is the workload
the tutorial's step scripts share (flags, model loading, data, the loop, checkpoints,
FSDP, CUDA graphs, reports), one concern per module.
"""

from adamw_kernel import TritonAdamW as AdamW
from kernel_ft.patching import KERNELS, KernelNotApplied, Report, apply
from swap_common import loss_only

__all__ = ["AdamW", "KERNELS", "KernelNotApplied", "Report", "apply", "loss_only"]
