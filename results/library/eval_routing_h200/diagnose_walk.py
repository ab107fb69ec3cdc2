# A diagnosis run on the GPU (NOTES Step 23): why the gradient probe of apply failed for a sequence classifier.
# The walk of attention_routing._reaching, with its traceback printed. Run from tests/ on the PYTHONPATH.
import torch, kernel_ft, transformers, traceback
from apply_test import tiny_config, DEVICE
import attention_routing
orig = attention_routing._reaching
def reaching(model, implementation):
    try:
        return orig(model, implementation)
    except Exception:
        traceback.print_exc()
        raise
attention_routing._reaching = reaching
torch.manual_seed(0)
config = tiny_config("Llama"); config.num_labels = 3
theirs = transformers.AutoModelForSequenceClassification.from_config(config).to(DEVICE).train()
print(kernel_ft.apply(theirs)["attention"], flush=True)
