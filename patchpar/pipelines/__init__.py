"""Prompt -> image pipelines."""

from patchpar.pipelines.loading import load_pipeline
from patchpar.pipelines.text2img import Output, Pipeline
from patchpar.sampling.guidance import Conditioning

__all__ = ["Conditioning", "Output", "Pipeline", "load_pipeline"]
