"""Composed table entries: one op's row made of ordinary kernel calls from several backends (each part an entry
point of its own backend; the composition, which no backend may hold, lives here). The table names them as
"module:function" like any row, so `import dispatch` imports none of them."""
