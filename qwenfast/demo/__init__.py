"""The demo world behind the embedded default model: synthetic shape pictures with captions
(`data`), a deterministic prompt-adherence analyser (`score`) and `qwenfast bench quality` (`bench`)."""
