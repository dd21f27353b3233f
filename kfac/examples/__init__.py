"""Support code of the old library's examples (`kfac.examples.mnist`), so
that scripts written for kfac 0.2.x that import it keep running."""
