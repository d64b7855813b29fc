"""Host-side processing for Qwen3-VL: images, videos, timestamps, prompt expansion, chat template.

Modules, in the order data flows: `media` (decoding to uint8 RGB), `image` and `video` (pixels,
grids, frame sampling, timestamps), `prompt` (placeholder expansion, tokenization), `chat` (chat
templates), `processor` (`Qwen3VLProcessor`, which joins them).

Mirrors HF transformers' `Qwen3VLProcessor` (processing_qwen3_vl.py), `Qwen2VLImageProcessorPil`
(image_processing_pil_qwen2_vl.py) and `Qwen3VLVideoProcessor` (video_processing_qwen3_vl.py) with
numpy + PIL only (no torch at run time). Token ids, grids and timestamps are identical to HF's;
image pixels are bit-identical to HF's PIL image processor; video pixels (and images against HF's
torchvision-backed image processor) differ only by resampling noise, since HF resizes videos with
torchvision's antialiased bicubic while this module uses PIL's bicubic (same kernel; rounding in
the separable passes differs, mostly where one axis shrinks and the other grows: mean < 0.3 of a
uint8 level, max a few levels, see the tests).

Speed: rescale + normalize run as float32 arithmetic verified at start-up to give the same bits as
HF's op order for all 256 levels (else a per-level lookup table); uint8 pixels are rearranged into
patch order before conversion; images and temporal-patch chunks of a video run on a thread pool
(`num_threads`, default min(8, cores)); outputs are written in place.

Keywords follow HF 5.x's groups (`text_kwargs`, `images_kwargs`, `videos_kwargs`, `common_kwargs`;
see `processor.py`), including its refusals; as in HF, call-time `min_pixels` / `max_pixels` reach
images only, call-time `min_frames` / `max_frames` change nothing (the processor's config decides;
set them with `from_pretrained(videos_kwargs=...)`), and call-time `max_video_tokens` caps the frames
under `cap_pixels_per_frame` (HF >= 5.25).

Deliberate differences from HF (each a clear error or a documented choice, never a silent
divergence on input both accept): a keyword no group knows is a TypeError (HF warns and ignores
it); non-integer float pixel arrays are refused (HF round-trips them through uint8 and rescales
twice); 16-bit images (PIL mode I;16, 16-bit PNG files, uint16 arrays) are scaled to 8 bits (HF
clips them at 255: nearly white); 2-D arrays are grayscale images; a list of PIL frames can be
sampled; an empty image, an empty prompt, and a video_metadata fps that is 0, negative or not
finite raise a ValueError naming the item (HF: ZeroDivisionError, an empty prompt, negative
timestamps); `num_frames` alone needs no `fps=None`.

Axis glossary (one letter per axis):
  P  flattened patches of all items, in (t, h-block, w-block, h-in-block, w-in-block) order
  D  patch vector C*T*p*p, ordered (channel, temporal, row, col)
  T  frames (videos) / temporal patch size
  H, W  pixel rows / columns;  C  channels (RGB)
  t, h, w  grid sizes in patches (grid_thw)

Output of `Qwen3VLProcessor.__call__` (same keys as HF's, plus `video_timestamps`):
  input_ids, attention_mask, mm_token_type_ids   [B, L] (0 text, 1 image, 2 video)
  pixel_values [P, D] float32, image_grid_thw [N_img, 3] int64
  pixel_values_videos [P, D] float32, video_grid_thw [N_vid, 3] int64
  video_timestamps: per video, the time in seconds of each temporal patch (the `<t.t seconds>` text)
  video_metadata: per video, a `VideoMetadata` (only with `return_metadata=True`, as in HF)

Research hook: `video_tokens_per_frame=[[n_0, ..., n_{t-1}], ...]` expands each video's placeholder
with caller-given per-frame token counts instead of h*w/merge^2 per frame (video pruning keeps
the per-frame timestamps and vision start/end markers; e.g. vLLM's EVS puts all retained tokens
in frame 0). `Qwen3VLProcessor.expand_and_tokenize` does the same from a first call's grids and
timestamps without touching pixels; `Qwen3VLProcessor.video_placeholder` builds one video's string.
"""

from .image import MAX_ASPECT_RATIO, ImageProcessor, smart_resize
from .media import VideoMetadata, load_image, load_video
from .processor import Qwen3VLProcessor
from .prompt import IMAGE_TOKEN, VIDEO_TOKEN, VISION_END, VISION_START
from .video import VideoProcessor, frame_timestamps, sample_frame_indices, smart_resize_video

__all__ = [
    "ImageProcessor",
    "Qwen3VLProcessor",
    "VideoMetadata",
    "VideoProcessor",
    "frame_timestamps",
    "load_image",
    "load_video",
    "sample_frame_indices",
    "smart_resize",
    "smart_resize_video",
]
