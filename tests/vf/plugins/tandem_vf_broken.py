"""A verifiers taskset that fails while it loads, as tasksets do offline (issue 43): `error`
"nltk" raises the LookupError nltk raises for a resource it cannot find (TextArena's Wordle
needs `averaged_perceptron_tagger_eng`), "runtime" a plain RuntimeError."""

import verifiers.v1 as vf

# nltk's message for a missing resource, as nltk.data.find writes it.
NLTK_MISSING = """
**********************************************************************
  Resource averaged_perceptron_tagger_eng not found.
  Please use the NLTK Downloader to obtain the resource:

  >>> import nltk
  >>> nltk.download('averaged_perceptron_tagger_eng')

  For more information see: https://www.nltk.org/data.html

  Attempted to load taggers/averaged_perceptron_tagger_eng/

  Searched in:
    - '/root/nltk_data'
    - '/usr/share/nltk_data'
**********************************************************************
"""


class BrokenConfig(vf.TasksetConfig):
    error: str = "nltk"


class BrokenTaskset(vf.Taskset[vf.Task, BrokenConfig]):
    def load(self):
        if self.config.error == "nltk":
            raise LookupError(NLTK_MISSING)
        raise RuntimeError("the word list server did not answer")
        yield  # a generator, as tasksets are


__all__ = ["BrokenTaskset"]
