#include <vector>

namespace geo {

class Polygon {
 public:
  explicit Polygon(std::vector<double> xs) : xs_(xs) {}

  double perimeter() const {
    double p = 0;
    for (double x : xs_) p += x;
    return p;
  }

 private:
  std::vector<double> xs_;
};

}  // namespace geo

template <typename T>
T clamp(T v, T lo, T hi) {
  return v < lo ? lo : (v > hi ? hi : v);
}

double geo::area(const Polygon& p) { return p.perimeter(); }
