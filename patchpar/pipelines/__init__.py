"""Prompt -> image pipelines."""

from patchpar.pipelines.text2img import Output, Pipeline, load_pipeline
from patchpar.sampling.guidance import Conditioning

__all__ = ["Conditioning", "Output", "Pipeline", "load_pipeline"]
