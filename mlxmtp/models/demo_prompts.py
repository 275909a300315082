"""Held-out prompts for the demo model: code from standard-library files that the
training script held out (listed in mlxmtp/demo_model/training.json), verbatim."""

HELD_OUT_PROMPTS = {
    'fnmatch': 'def translate(pat):\n    """Translate a shell PATTERN to a regular expression.\n\n    There is no way to quote meta-characters.\n    """\n\n    STAR = object()\n    res = []\n    add = res.append\n    i, n = 0, len(pat)\n    while i < n:\n        c = pat[i]\n        i = i+1\n',
    'csv': 'class DictReader:\n    def __init__(self, f, fieldnames=None, restkey=None, restval=None,\n                 dialect="excel", *args, **kwds):\n        self._fieldnames = fieldnames   # list of keys for the dict\n        self.restkey = restkey          # key to catch long rows\n        self.restval = restval          # default value for short rows\n        self.reader = reader(f, dialect, *args, **kwds)\n        self.dialect = dialect\n        self.line_num = 0\n\n    def __iter__(self):\n        return self\n',
    'netrc': 'class _netrclex:\n    def __init__(self, fp):\n        self.lineno = 1\n        self.instream = fp\n        self.whitespace = "\\n\\t\\r "\n        self.pushback = []\n\n    def _read_char(self):\n        ch = self.instream.read(1)\n        if ch == "\\n":\n            self.lineno += 1\n        return ch\n\n    def get_token(self):\n        if self.pushback:\n',
    'filecmp': 'def cmp(f1, f2, shallow=True):\n    """Compare two files.\n\n    Arguments:\n\n    f1 -- First file name\n\n',
    'pyclbr': 'class _Object:\n    "Information about Python class or function."\n    def __init__(self, module, name, file, lineno, end_lineno, parent):\n        self.module = module\n        self.name = name\n        self.file = file\n        self.lineno = lineno\n        self.end_lineno = end_lineno\n        self.parent = parent\n        self.children = {}\n        if parent is not None:\n',
}
