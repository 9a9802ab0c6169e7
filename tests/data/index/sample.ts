export interface Shape {
  area(): number;
}

// A circle of radius r.
export class Circle implements Shape {
  constructor(private r: number) {}

  area(): number {
    return Math.PI * this.r * this.r;
  }

  scale(by: number): Circle {
    return new Circle(this.r * by);
  }
}

export function totalArea(shapes: Shape[]): number {
  return shapes.reduce((s, x) => s + x.area(), 0);
}
