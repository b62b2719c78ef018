# Perplexity against density, one line per series, for examples/sweep/Makefile, which calls it
# with three variables: out (the PNG to write), dir (where the data files are) and series (their
# names, space-separated; dir/NAME.dat holds "density perplexity" lines sorted by density).
if (strstrt(GPVAL_TERMINALS, "pngcairo") > 0) {
    set terminal pngcairo size 900,560
} else {
    set terminal png size 900,560
}
set output out
set title "Perplexity of the merged model against density"
set xlabel "density (fraction of each task vector kept)"
set ylabel "perplexity"
set key outside right top
set grid
set offsets graph 0.05, graph 0.05, graph 0.05, graph 0.05
plot for [s in series] dir."/".s.".dat" using 1:2 with linespoints pointtype 7 title s noenhanced
