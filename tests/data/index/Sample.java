package demo;

import java.util.List;

/** Sums lists. */
public class Sample {
    private int total;

    public Sample() {
        this.total = 0;
    }

    /** Adds every value. */
    public int addAll(List<Integer> values) {
        for (int v : values) {
            total += v;
        }
        return total;
    }

    interface Visitor {
        void visit(int v);
    }
}
